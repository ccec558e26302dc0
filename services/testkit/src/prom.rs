//! Reading the Prometheus text the services' `/metrics` serve, for tests and
//! for the load driver's CPU figures.

/// The sum of the samples named `name` whose labels include all of
/// `labels`, in an exposition text (`None` when no sample matches). For
/// tests and tools reading `/metrics`; label order does not matter.
pub fn sum_samples(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut total = None;
    for line in exposition.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (series_name, series_labels) = match series.split_once('{') {
            Some((n, rest)) => (n, parse_labels(rest.strip_suffix('}').unwrap_or(rest))),
            None => (series, Vec::new()),
        };
        if series_name != name
            || !labels
                .iter()
                .all(|(k, v)| series_labels.iter().any(|(sk, sv)| sk == k && sv == v))
        {
            continue;
        }
        if let Ok(value) = value.parse::<f64>() {
            *total.get_or_insert(0.0) += value;
        }
    }
    total
}

/// A series expected in an exposition: its name, labels it must carry, and
/// the sum of its samples.
pub type Expected<'a> = (&'a str, &'a [(&'a str, &'a str)], f64);

/// Assert that every `(name, labels, value)` sums to `value` in an
/// exposition text: a service's metrics contract (the names and labels its
/// dashboard and alerts read), checked in one place for every service.
#[track_caller]
pub fn assert_samples(exposition: &str, expected: &[Expected<'_>]) {
    for &(name, labels, value) in expected {
        assert_eq!(
            sum_samples(exposition, name, labels),
            Some(value),
            "{name} {labels:?} in\n{exposition}"
        );
    }
}

/// `a="x",b="y\"z"` into pairs, unescaping values.
fn parse_labels(raw: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = raw.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() || chars.next() != Some('"') {
            break;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => break,
                },
                '"' => break,
                c => value.push(c),
            }
        }
        pairs.push((key.trim_start_matches(',').to_owned(), value));
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_summed_whatever_the_label_order() {
        let text =
            "# TYPE x counter\nx_total{b=\"2\",a=\"1\"} 3\nx_total{a=\"1\",b=\"q\\\"\"} 4\ny 1\n";
        assert_eq!(
            sum_samples(text, "x_total", &[("a", "1"), ("b", "2")]),
            Some(3.0)
        );
        assert_eq!(sum_samples(text, "x_total", &[("a", "1")]), Some(7.0));
        assert_eq!(sum_samples(text, "x_total", &[("b", "q\"")]), Some(4.0));
        assert_eq!(sum_samples(text, "y", &[]), Some(1.0));
        assert_eq!(sum_samples(text, "x_total", &[("a", "2")]), None);
    }
}
