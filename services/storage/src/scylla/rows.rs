//! Reading replies: typed rows for reads, LWT replies (whose columns differ
//! between ScyllaDB and Cassandra), and the errors of database calls.

use imdedup_domain::{
    Error, ErrorKind,
    model::{ClientMsgId, ConversationId, Fingerprint, MessageKey, Receipt, Sender, StoredMessage},
};
use scylla::{
    DeserializeRow,
    deserialize::{
        FrameSlice,
        row::{ColumnIterator, DeserializeRow},
        value::DeserializeValue,
    },
    frame::response::result::ColumnSpec,
    response::query_result::QueryResult,
};

pub(super) fn db_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(format!("cql {what}: {e}"))
}

/// A failure after which the message may be stored.
pub(super) fn maybe_stored(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::MaybeStored, format!("cql {what}: {e}"))
}

/// The rows of a reply, each decoded as `R` (its columns checked by name and
/// type once per reply).
pub(super) fn rows<R>(result: QueryResult) -> Result<Vec<R>, Error>
where
    R: for<'frame> DeserializeRow<'frame, 'frame>,
{
    let rows = result
        .into_rows_result()
        .map_err(|e| db_error("result", e))?;
    rows.rows::<R>()
        .map_err(|e| db_error("result", e))?
        .map(|row| row.map_err(|e| db_error("row", e)))
        .collect()
}

/// A row of `messages_by_key`, as `SELECT {COLUMNS}` reads it.
#[derive(Debug, DeserializeRow)]
pub(super) struct KeyRow {
    sender: String,
    client_msg_id: Vec<u8>,
    conversation: String,
    body: String,
    server_id: i64,
    seq: i64,
    stored_at_ms: i64,
}

impl KeyRow {
    pub(super) fn into_message(self) -> Result<StoredMessage, Error> {
        stored_message(
            self.sender,
            self.client_msg_id,
            self.conversation,
            self.body,
            [self.server_id, self.seq, self.stored_at_ms],
        )
    }
}

/// A row of `messages_by_conversation`, as the history reads it. Only the
/// key columns are sure to be set: a row abandoned before its pending write
/// landed has nothing else.
#[derive(Debug, DeserializeRow)]
pub(super) struct HistoryRow {
    sender: Option<String>,
    client_msg_id: Option<Vec<u8>>,
    conversation: String,
    body: Option<String>,
    server_id: Option<i64>,
    seq: i64,
    stored_at_ms: Option<i64>,
    pub(super) pending: Option<bool>,
    pub(super) committed: Option<bool>,
    pub(super) abandoned: Option<bool>,
}

impl HistoryRow {
    pub(super) fn into_message(self) -> Result<StoredMessage, Error> {
        let Self {
            sender,
            client_msg_id,
            conversation,
            body,
            server_id,
            seq,
            stored_at_ms,
            ..
        } = self;
        match (sender, client_msg_id, body, server_id, stored_at_ms) {
            (Some(sender), Some(id), Some(body), Some(server_id), Some(stored_at_ms)) => {
                stored_message(
                    sender,
                    id,
                    conversation,
                    body,
                    [server_id, seq, stored_at_ms],
                )
            }
            _ => Err(Error::internal(format!(
                "history row {conversation}/{seq} without its message"
            ))),
        }
    }
}

fn stored_message(
    sender: String,
    client_msg_id: Vec<u8>,
    conversation: String,
    body: String,
    [server_id, seq, stored_at_ms]: [i64; 3],
) -> Result<StoredMessage, Error> {
    let bad = |e: Error| Error::internal(format!("malformed stored row: {}", e.message()));
    Ok(StoredMessage {
        key: MessageKey {
            sender: Sender::parse(sender).map_err(bad)?,
            client_msg_id: ClientMsgId::parse(client_msg_id).map_err(bad)?,
        },
        conversation: ConversationId::parse(conversation).map_err(bad)?,
        body,
        receipt: Receipt {
            server_id: u64::try_from(server_id).unwrap_or_default(),
            seq: u64::try_from(seq).unwrap_or_default(),
        },
        stored_at_ms,
    })
}

/// The columns an LWT reply carries besides `[applied]`. They differ by
/// database and outcome: Cassandra sends none when applied and, when not,
/// the existing row (`IF NOT EXISTS`) or the condition's columns (`IF x =
/// ?`); ScyllaDB sends every column, null when applied. So each reply type
/// takes the columns it knows by name, typed, and ignores the others. A
/// conditional batch's reply may have several rows (ScyllaDB: one per
/// conditional statement, in their order; Cassandra: one per row its
/// conditions read, in clustering order): their columns are taken in turn,
/// so a type read from a batch keeps the values that are not null.
pub(super) trait LwtColumns: Default {
    fn take(&mut self, column: Column<'_, '_>) -> Result<(), Error>;
}

/// Read an LWT reply: whether it was applied, and what its rows carried.
pub(super) fn lwt<T: LwtColumns>(result: QueryResult) -> Result<(bool, T), Error> {
    let rows = result
        .into_rows_result()
        .map_err(|e| db_error("result", e))?;
    let rows = rows
        .rows::<ColumnIterator>()
        .map_err(|e| db_error("result", e))?
        .map(|row| {
            let row = row.map_err(|e| db_error("row", e))?;
            Ok::<_, Error>(row.map(|column| {
                let column = column.map_err(|e| db_error("row", e))?;
                Ok(Column {
                    spec: column.spec,
                    slice: column.slice,
                })
            }))
        });
    lwt_rows(rows)
}

/// An LWT reply's rows, their columns taken in turn.
fn lwt_rows<'frame, 'metadata, T, R>(
    mut rows: impl Iterator<Item = Result<R, Error>>,
) -> Result<(bool, T), Error>
where
    T: LwtColumns,
    R: IntoIterator<Item = Result<Column<'frame, 'metadata>, Error>>,
{
    let first = rows
        .next()
        .ok_or_else(|| Error::internal("LWT reply without a row"))??;
    let (applied, mut columns) = lwt_columns(first, T::default())?;
    for row in rows {
        let (also, more) = lwt_columns(row?, columns)?;
        if also != applied {
            return Err(Error::internal(
                "LWT reply whose rows disagree on [applied]",
            ));
        }
        columns = more;
    }
    Ok((applied, columns))
}

/// A column of a reply's row: its name and type, and its value (None: null).
pub(super) struct Column<'frame, 'metadata> {
    pub(super) spec: &'metadata ColumnSpec<'metadata>,
    pub(super) slice: Option<FrameSlice<'frame>>,
}

/// An LWT reply's row, column by column, into `columns`.
fn lwt_columns<'frame, 'metadata, T: LwtColumns>(
    row: impl IntoIterator<Item = Result<Column<'frame, 'metadata>, Error>>,
    mut columns: T,
) -> Result<(bool, T), Error> {
    let mut applied = None;
    for column in row {
        let column = column?;
        if column.spec.name() == "[applied]" {
            applied = value::<Option<bool>>(column)?;
        } else {
            columns.take(column)?;
        }
    }
    let applied = applied.ok_or_else(|| Error::internal("LWT reply without [applied]"))?;
    Ok((applied, columns))
}

/// A column's value as `V`, its type checked.
pub(super) fn value<'frame, 'metadata, V>(column: Column<'frame, 'metadata>) -> Result<V, Error>
where
    V: DeserializeValue<'frame, 'metadata>,
{
    let name = column.spec.name();
    let typ = column.spec.typ();
    V::type_check(typ).map_err(|e| Error::internal(format!("column {name}: {e}")))?;
    V::deserialize(typ, column.slice).map_err(|e| Error::internal(format!("column {name}: {e}")))
}

/// What a conditional batch that did not apply comes back with: the key
/// row (in its conversation's partition, at a negative `seq`: its slot),
/// when the slot is held — whose key, and what it says of that message (not
/// the body: its fingerprint tells a resend from another message sent
/// under the ID) — and the conversation's `last_seq` (a static cell, so on
/// every row of the partition; absent or null when never set).
#[derive(Default)]
pub(super) struct ExistingSlot {
    sender: Option<String>,
    client_msg_id: Option<Vec<u8>>,
    server_id: Option<i64>,
    key_seq: Option<i64>,
    fingerprint: Option<i64>,
    stored_at_ms: Option<i64>,
    last_seq: Option<i64>,
}

impl LwtColumns for ExistingSlot {
    fn take(&mut self, column: Column<'_, '_>) -> Result<(), Error> {
        // A later row's null never hides an earlier row's value.
        fn keep<T>(cell: &mut Option<T>, new: Option<T>) {
            if new.is_some() {
                *cell = new;
            }
        }
        match column.spec.name() {
            "sender" => keep(&mut self.sender, value(column)?),
            "client_msg_id" => keep(&mut self.client_msg_id, value(column)?),
            "server_id" => keep(&mut self.server_id, value(column)?),
            "key_seq" => keep(&mut self.key_seq, value(column)?),
            "fingerprint" => keep(&mut self.fingerprint, value(column)?),
            "stored_at_ms" => keep(&mut self.stored_at_ms, value(column)?),
            "last_seq" => keep(&mut self.last_seq, value(column)?),
            _ => {}
        }
        Ok(())
    }
}

/// The message a slot's key row stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SlotHolder {
    pub(super) key: MessageKey,
    pub(super) receipt: Receipt,
    pub(super) fingerprint: Fingerprint,
    pub(super) stored_at_ms: i64,
}

impl ExistingSlot {
    /// The conversation's `last_seq` as the refused batch found it (None:
    /// never set), and what holds the key's slot if the reply carried a key
    /// row (an error if only part of one).
    pub(super) fn into_parts(self) -> (Option<u64>, Option<Result<SlotHolder, Error>>) {
        let last_seq = self.last_seq.and_then(|seq| u64::try_from(seq).ok());
        let holder = self.key_seq.is_some().then(|| self.into_holder());
        (last_seq, holder)
    }

    /// What holds the slot, when the reply carried its key row whole.
    pub(super) fn into_holder(self) -> Result<SlotHolder, Error> {
        match self {
            Self {
                sender: Some(sender),
                client_msg_id: Some(id),
                server_id: Some(server_id),
                key_seq: Some(seq),
                fingerprint: Some(fingerprint),
                stored_at_ms: Some(stored_at_ms),
                last_seq: _,
            } => {
                let bad = |e: Error| Error::internal(format!("malformed key row: {}", e.message()));
                Ok(SlotHolder {
                    key: MessageKey {
                        sender: Sender::parse(sender).map_err(bad)?,
                        client_msg_id: ClientMsgId::parse(id).map_err(bad)?,
                    },
                    receipt: Receipt {
                        server_id: u64::try_from(server_id).unwrap_or_default(),
                        seq: u64::try_from(seq).unwrap_or_default(),
                    },
                    fingerprint: Fingerprint(u64::from_le_bytes(fingerprint.to_le_bytes())),
                    stored_at_ms,
                })
            }
            _ => Err(Error::internal(
                "conditional batch reply without the whole key row",
            )),
        }
    }
}

/// A fingerprint as CQL's signed bigint (the same 64 bits).
pub(super) fn fingerprint_cell(fingerprint: Fingerprint) -> i64 {
    i64::from_le_bytes(fingerprint.0.to_le_bytes())
}

pub(super) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
pub(super) mod tests {
    use scylla::{
        deserialize::FrameSlice,
        frame::response::result::{ColumnType, NativeType, TableSpec},
    };

    use super::*;

    /// A reply cell: its column's name and type, and its serialized value
    /// (None: null).
    pub(in crate::scylla) type Cell = (&'static str, NativeType, Option<Vec<u8>>);

    pub(in crate::scylla) fn big(v: i64) -> Option<Vec<u8>> {
        Some(v.to_be_bytes().to_vec())
    }

    pub(in crate::scylla) fn text(v: &str) -> Option<Vec<u8>> {
        Some(v.as_bytes().to_vec())
    }

    pub(in crate::scylla) fn applied(v: bool) -> Cell {
        ("[applied]", NativeType::Boolean, Some(vec![u8::from(v)]))
    }

    /// Read `cells` as an LWT reply's row.
    pub(in crate::scylla) fn reply<T: LwtColumns>(cells: &[Cell]) -> Result<(bool, T), Error> {
        replies(&[cells])
    }

    /// Read `rows` as an LWT reply's rows.
    pub(in crate::scylla) fn replies<T: LwtColumns>(rows: &[&[Cell]]) -> Result<(bool, T), Error> {
        let specs: Vec<Vec<ColumnSpec<'_>>> = rows
            .iter()
            .map(|cells| {
                cells
                    .iter()
                    .map(|(name, typ, _)| {
                        ColumnSpec::borrowed(
                            name,
                            ColumnType::Native(typ.clone()),
                            TableSpec::borrowed("ks", "t"),
                        )
                    })
                    .collect()
            })
            .collect();
        lwt_rows(rows.iter().zip(&specs).map(|(cells, specs)| {
            Ok(cells.iter().zip(specs).map(|((_, _, cell), spec)| {
                Ok(Column {
                    spec,
                    slice: cell.as_deref().map(FrameSlice::new_borrowed),
                })
            }))
        }))
    }

    fn key_row(key_seq: i64) -> Vec<Cell> {
        vec![
            ("conversation", NativeType::Text, text("dm:ana:ben")),
            ("seq", NativeType::BigInt, big(-17)),
            ("abandoned", NativeType::Boolean, None),
            ("body", NativeType::Text, None),
            ("client_msg_id", NativeType::Blob, Some(b"m1".to_vec())),
            ("fingerprint", NativeType::BigInt, big(-5)),
            ("key_seq", NativeType::BigInt, big(key_seq)),
            ("sender", NativeType::Text, text("ana")),
            ("server_id", NativeType::BigInt, big(7)),
            ("stored_at_ms", NativeType::BigInt, big(1_700_000_000_000)),
        ]
    }

    #[test]
    fn a_batch_that_did_not_apply_gives_the_key_row_on_either_database() {
        // Cassandra: [applied] first, then the existing row.
        let mut cassandra = vec![applied(false)];
        cassandra.extend(key_row(42));
        // ScyllaDB sends the columns in the table's order; any order does.
        let mut scylla = key_row(42);
        scylla.reverse();
        scylla.insert(3, applied(false));
        for cells in [cassandra, scylla] {
            let (applied, existing) = reply::<ExistingSlot>(&cells).unwrap();
            assert!(!applied);
            let holder = existing.into_holder().unwrap();
            assert_eq!(
                holder.receipt,
                Receipt {
                    server_id: 7,
                    seq: 42
                }
            );
            assert_eq!(holder.key.sender.as_str(), "ana");
            assert_eq!(holder.key.client_msg_id.as_bytes(), b"m1");
            // The bigint's 64 bits, not its value.
            assert_eq!(holder.fingerprint, Fingerprint(u64::MAX - 4));
            assert_eq!(fingerprint_cell(holder.fingerprint), -5);
        }
    }

    /// The static row as a refused batch gives it: the partition's
    /// `last_seq` (None: null), no clustering row.
    fn static_row(last_seq: Option<i64>) -> Vec<Cell> {
        vec![
            applied(false),
            ("conversation", NativeType::Text, text("dm:ana:ben")),
            ("seq", NativeType::BigInt, None),
            ("last_seq", NativeType::BigInt, last_seq.and_then(big)),
            ("sender", NativeType::Text, None),
            ("key_seq", NativeType::BigInt, None),
        ]
    }

    #[test]
    fn a_batch_refused_on_a_held_key_gives_the_key_row_and_last_seq_on_either_database() {
        // Cassandra (as 5.0.9 answers): one row, the key row with the
        // partition's static cell.
        let mut cassandra = vec![applied(false)];
        cassandra.extend(key_row(42));
        cassandra.push(("last_seq", NativeType::BigInt, big(57)));
        // ScyllaDB: a row per conditional statement, in their order (the
        // key row, then the `last_seq` update's static row).
        let mut scylla_key = key_row(42);
        scylla_key.insert(0, applied(false));
        scylla_key.push(("last_seq", NativeType::BigInt, big(57)));
        let scylla_static = static_row(Some(57));
        for rows in [
            vec![&cassandra[..]],
            vec![&scylla_key[..], &scylla_static[..]],
        ] {
            let (applied, existing) = replies::<ExistingSlot>(&rows).unwrap();
            assert!(!applied);
            let (last_seq, holder) = existing.into_parts();
            assert_eq!(last_seq, Some(57));
            let holder = holder.expect("a key row").unwrap();
            assert_eq!(holder.receipt.seq, 42);
            assert_eq!(holder.key.sender.as_str(), "ana");
        }
    }

    #[test]
    fn a_batch_refused_on_last_seq_alone_gives_its_value_on_either_database() {
        // Cassandra: the static row alone; with `last_seq` null, [applied]
        // alone.
        // ScyllaDB: the key row's old version (all null: no row), then the
        // static row.
        let null_key: Vec<Cell> = std::iter::once(applied(false))
            .chain(
                key_row(1)
                    .into_iter()
                    .map(|(name, typ, _)| (name, typ, None)),
            )
            .collect();
        for (want, rows) in [
            (Some(9), vec![&static_row(Some(9))[..]]),
            (None, vec![&[applied(false)][..]]),
            (Some(9), vec![&null_key[..], &static_row(Some(9))[..]]),
            (None, vec![&null_key[..], &static_row(None)[..]]),
        ] {
            let (applied, existing) = replies::<ExistingSlot>(&rows).unwrap();
            assert!(!applied);
            let (last_seq, holder) = existing.into_parts();
            assert_eq!(last_seq, want);
            assert!(holder.is_none(), "no key row in this reply");
        }
    }

    #[test]
    fn a_reply_whose_rows_disagree_on_applied_is_an_error() {
        let mut second = static_row(Some(3));
        second[0] = applied(true);
        let e = replies::<ExistingSlot>(&[&static_row(Some(3)), &second])
            .err()
            .unwrap();
        assert!(e.message().contains("disagree"), "{e}");
    }

    #[test]
    fn a_batch_that_applied_is_read_from_cassandras_and_scyllas_replies() {
        // Cassandra: [applied] alone.
        let (applied_, _) = reply::<ExistingSlot>(&[applied(true)]).unwrap();
        assert!(applied_);
        // ScyllaDB: every column, null.
        let mut cells = vec![applied(true)];
        cells.extend(
            key_row(1)
                .into_iter()
                .map(|(name, typ, _)| (name, typ, None)),
        );
        let (applied_, existing) = reply::<ExistingSlot>(&cells).unwrap();
        assert!(applied_);
        assert!(
            existing.into_holder().is_err(),
            "no holder in an applied reply"
        );
    }

    #[test]
    fn a_reply_without_applied_or_with_a_wrong_type_is_an_error_not_a_guess() {
        let e = reply::<ExistingSlot>(&key_row(1)).err().unwrap();
        assert!(e.message().contains("[applied]"), "{e}");
        let mut cells = vec![applied(false)];
        cells.extend(key_row(1));
        cells[7] = ("key_seq", NativeType::Text, text("42"));
        let e = reply::<ExistingSlot>(&cells).err().unwrap();
        assert!(e.message().contains("column key_seq"), "{e}");
    }

    #[test]
    fn a_partial_key_row_is_not_taken_for_the_holder() {
        // A history row (no key columns) where a key row was expected.
        let mut cells = vec![applied(false)];
        cells.extend(
            key_row(1)
                .into_iter()
                .filter(|(name, ..)| *name != "fingerprint"),
        );
        let (_, existing) = reply::<ExistingSlot>(&cells).unwrap();
        assert!(existing.into_holder().is_err());
    }
}
