//! Reading replies: rows by column name (untyped, because ScyllaDB and
//! Cassandra answer LWTs with different columns), LWT replies, and the
//! errors of database calls.

use std::collections::HashMap;

use imdedup_core::{
    Error, ErrorKind,
    model::{ClientMsgId, ConversationId, MessageKey, Receipt, Sender, StoredMessage},
};
use scylla::{
    response::query_result::QueryResult,
    value::{CqlValue, Row},
};

pub(super) fn db_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(format!("cql {what}: {e}"))
}

/// A failure after which the message may be stored.
pub(super) fn maybe_stored(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::MaybeStored, format!("cql {what}: {e}"))
}

pub(super) fn rows(result: QueryResult) -> Result<Vec<HashMap<String, Option<CqlValue>>>, Error> {
    let rows = result
        .into_rows_result()
        .map_err(|e| db_error("result", e))?;
    let names: Vec<String> = rows
        .column_specs()
        .iter()
        .map(|c| c.name().to_owned())
        .collect();
    rows.rows::<Row>()
        .map_err(|e| db_error("result", e))?
        .map(|row| {
            let row = row.map_err(|e| db_error("row", e))?;
            Ok(names.iter().cloned().zip(row.columns).collect())
        })
        .collect()
}

/// Read an LWT reply: whether it was applied, and the existing row's columns
/// (present when not applied; ScyllaDB also sends them, as nulls or the old
/// row, when applied).
pub(super) fn lwt(result: QueryResult) -> Result<(bool, HashMap<String, Option<CqlValue>>), Error> {
    let mut rows = rows(result)?;
    let row = rows
        .pop()
        .ok_or_else(|| Error::internal("LWT reply without a row"))?;
    let applied = matches!(row.get("[applied]"), Some(Some(CqlValue::Boolean(true))));
    Ok((applied, row))
}

fn column<'a>(
    row: &'a HashMap<String, Option<CqlValue>>,
    name: &str,
) -> Result<&'a CqlValue, Error> {
    row.get(name)
        .and_then(Option::as_ref)
        .ok_or_else(|| Error::internal(format!("row without column {name}")))
}

fn text(row: &HashMap<String, Option<CqlValue>>, name: &str) -> Result<String, Error> {
    match column(row, name)? {
        CqlValue::Text(s) | CqlValue::Ascii(s) => Ok(s.clone()),
        other => Err(Error::internal(format!(
            "column {name} is {other:?}, not text"
        ))),
    }
}

fn bigint(row: &HashMap<String, Option<CqlValue>>, name: &str) -> Result<i64, Error> {
    match column(row, name)? {
        CqlValue::BigInt(v) => Ok(*v),
        other => Err(Error::internal(format!(
            "column {name} is {other:?}, not bigint"
        ))),
    }
}

fn blob(row: &HashMap<String, Option<CqlValue>>, name: &str) -> Result<Vec<u8>, Error> {
    match column(row, name)? {
        CqlValue::Blob(v) => Ok(v.clone()),
        other => Err(Error::internal(format!(
            "column {name} is {other:?}, not blob"
        ))),
    }
}

pub(super) fn to_message(row: &HashMap<String, Option<CqlValue>>) -> Result<StoredMessage, Error> {
    let bad = |e: Error| Error::internal(format!("malformed stored row: {}", e.message()));
    Ok(StoredMessage {
        key: MessageKey {
            sender: Sender::parse(text(row, "sender")?).map_err(bad)?,
            client_msg_id: ClientMsgId::parse(blob(row, "client_msg_id")?).map_err(bad)?,
        },
        conversation: ConversationId::parse(text(row, "conversation")?).map_err(bad)?,
        body: text(row, "body")?,
        receipt: Receipt {
            server_id: u64::try_from(bigint(row, "server_id")?).unwrap_or_default(),
            seq: u64::try_from(bigint(row, "seq")?).unwrap_or_default(),
        },
        stored_at_ms: bigint(row, "stored_at_ms")?,
    })
}

pub(super) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
