//! Reading replies: typed rows for reads, LWT replies (whose columns differ
//! between ScyllaDB and Cassandra), and the errors of database calls.

use imdedup_domain::{
    Error, ErrorKind,
    model::{ClientMsgId, ConversationId, MessageKey, Receipt, Sender, StoredMessage},
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
/// takes the columns it knows by name, typed, and ignores the others.
pub(super) trait LwtColumns: Default {
    fn take(&mut self, column: Column<'_, '_>) -> Result<(), Error>;
}

/// Read an LWT reply: whether it was applied, and what it carried.
pub(super) fn lwt<T: LwtColumns>(result: QueryResult) -> Result<(bool, T), Error> {
    let rows = result
        .into_rows_result()
        .map_err(|e| db_error("result", e))?;
    let row = rows
        .rows::<ColumnIterator>()
        .map_err(|e| db_error("result", e))?
        .next()
        .ok_or_else(|| Error::internal("LWT reply without a row"))?
        .map_err(|e| db_error("row", e))?;
    lwt_columns(row.map(|column| {
        let column = column.map_err(|e| db_error("row", e))?;
        Ok(Column {
            spec: column.spec,
            slice: column.slice,
        })
    }))
}

/// A column of a reply's row: its name and type, and its value (None: null).
pub(super) struct Column<'frame, 'metadata> {
    pub(super) spec: &'metadata ColumnSpec<'metadata>,
    pub(super) slice: Option<FrameSlice<'frame>>,
}

/// An LWT reply's row, column by column.
fn lwt_columns<'frame, 'metadata, T: LwtColumns>(
    row: impl IntoIterator<Item = Result<Column<'frame, 'metadata>, Error>>,
) -> Result<(bool, T), Error> {
    let mut applied = None;
    let mut columns = T::default();
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

/// The existing row an `INSERT INTO messages_by_key … IF NOT EXISTS` that
/// did not apply comes back with.
#[derive(Default)]
pub(super) struct ExistingKey {
    sender: Option<String>,
    client_msg_id: Option<Vec<u8>>,
    conversation: Option<String>,
    body: Option<String>,
    server_id: Option<i64>,
    seq: Option<i64>,
    stored_at_ms: Option<i64>,
}

impl LwtColumns for ExistingKey {
    fn take(&mut self, column: Column<'_, '_>) -> Result<(), Error> {
        match column.spec.name() {
            "sender" => self.sender = value(column)?,
            "client_msg_id" => self.client_msg_id = value(column)?,
            "conversation" => self.conversation = value(column)?,
            "body" => self.body = value(column)?,
            "server_id" => self.server_id = value(column)?,
            "seq" => self.seq = value(column)?,
            "stored_at_ms" => self.stored_at_ms = value(column)?,
            _ => {}
        }
        Ok(())
    }
}

impl ExistingKey {
    /// The original message, when the reply carried it whole.
    pub(super) fn into_message(self) -> Result<StoredMessage, Error> {
        match self {
            Self {
                sender: Some(sender),
                client_msg_id: Some(id),
                conversation: Some(conversation),
                body: Some(body),
                server_id: Some(server_id),
                seq: Some(seq),
                stored_at_ms: Some(stored_at_ms),
            } => stored_message(
                sender,
                id,
                conversation,
                body,
                [server_id, seq, stored_at_ms],
            ),
            _ => Err(Error::internal("LWT reply without the whole existing row")),
        }
    }
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
        let specs: Vec<ColumnSpec<'_>> = cells
            .iter()
            .map(|(name, typ, _)| {
                ColumnSpec::borrowed(
                    name,
                    ColumnType::Native(typ.clone()),
                    TableSpec::borrowed("ks", "t"),
                )
            })
            .collect();
        lwt_columns(cells.iter().zip(&specs).map(|((_, _, cell), spec)| {
            Ok(Column {
                spec,
                slice: cell.as_deref().map(FrameSlice::new_borrowed),
            })
        }))
    }

    fn key_row(seq: i64) -> Vec<Cell> {
        vec![
            ("sender", NativeType::Text, text("ana")),
            ("client_msg_id", NativeType::Blob, Some(b"m1".to_vec())),
            ("conversation", NativeType::Text, text("dm:ana:ben")),
            ("body", NativeType::Text, text("hi")),
            ("server_id", NativeType::BigInt, big(7)),
            ("seq", NativeType::BigInt, big(seq)),
            ("stored_at_ms", NativeType::BigInt, big(1_700_000_000_000)),
        ]
    }

    #[test]
    fn an_insert_that_did_not_apply_gives_the_original_on_either_database() {
        // Cassandra: [applied] first, then the existing row.
        let mut cassandra = vec![applied(false)];
        cassandra.extend(key_row(42));
        // ScyllaDB sends the columns in the table's order; any order does.
        let mut scylla = key_row(42);
        scylla.reverse();
        scylla.insert(3, applied(false));
        for cells in [cassandra, scylla] {
            let (applied, existing) = reply::<ExistingKey>(&cells).unwrap();
            assert!(!applied);
            let original = existing.into_message().unwrap();
            assert_eq!(
                original.receipt,
                Receipt {
                    server_id: 7,
                    seq: 42
                }
            );
            assert_eq!(original.key.sender.as_str(), "ana");
            assert_eq!(original.key.client_msg_id.as_bytes(), b"m1");
            assert_eq!(original.conversation.as_str(), "dm:ana:ben");
            assert_eq!(original.body, "hi");
        }
    }

    #[test]
    fn an_insert_that_applied_is_read_from_cassandras_and_scyllas_replies() {
        // Cassandra: [applied] alone.
        let (applied_, _) = reply::<ExistingKey>(&[applied(true)]).unwrap();
        assert!(applied_);
        // ScyllaDB: every column, null.
        let mut cells = vec![applied(true)];
        cells.extend(
            key_row(1)
                .into_iter()
                .map(|(name, typ, _)| (name, typ, None)),
        );
        let (applied_, existing) = reply::<ExistingKey>(&cells).unwrap();
        assert!(applied_);
        assert!(
            existing.into_message().is_err(),
            "no original in an applied reply"
        );
    }

    #[test]
    fn a_reply_without_applied_or_with_a_wrong_type_is_an_error_not_a_guess() {
        let e = reply::<ExistingKey>(&key_row(1)).err().unwrap();
        assert!(e.message().contains("[applied]"), "{e}");
        let mut cells = vec![applied(false)];
        cells.extend(key_row(1));
        cells[6] = ("seq", NativeType::Text, text("42"));
        let e = reply::<ExistingKey>(&cells).err().unwrap();
        assert!(e.message().contains("column seq"), "{e}");
    }

    #[test]
    fn a_partial_existing_row_is_not_taken_for_the_original() {
        let mut cells = vec![applied(false)];
        cells.extend(key_row(1).into_iter().filter(|(name, ..)| *name != "body"));
        let (_, existing) = reply::<ExistingKey>(&cells).unwrap();
        assert!(existing.into_message().is_err());
    }
}
