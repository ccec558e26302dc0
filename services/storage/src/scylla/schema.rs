//! The schema: keyspace and tables, created or updated by [`migrate`].

use imdedup_domain::Error;
use scylla::client::session::Session;

use super::{
    ScyllaOptions,
    options::check_keyspace_name,
    rows::{db_error, rows},
};

/// Whether the server is ScyllaDB (rather than Cassandra).
pub async fn is_scylla(session: &Session) -> Result<bool, Error> {
    let result = session
        .query_unpaged(
            "SELECT table_name FROM system_schema.tables \
             WHERE keyspace_name = 'system_schema' AND table_name = 'scylla_tables'",
            (),
        )
        .await
        .map_err(|e| db_error("probe", e))?;
    Ok(!rows::<(String,)>(result)?.is_empty())
}

/// Create the keyspace and tables if they do not exist. Idempotent.
///
/// ScyllaDB does not support LWT in tablets keyspaces, so on ScyllaDB the
/// keyspace is created with tablets disabled (on versions without tablets
/// the option is left out).
pub async fn migrate(session: &Session, options: &ScyllaOptions) -> Result<(), Error> {
    check_keyspace_name(&options.keyspace)?;
    let ks = &options.keyspace;
    let create_keyspace = format!(
        "CREATE KEYSPACE IF NOT EXISTS {ks} WITH replication = \
         {{'class': 'NetworkTopologyStrategy', 'replication_factor': {}}}",
        options.replication_factor
    );
    if is_scylla(session).await? {
        let with_tablets_off = format!("{create_keyspace} AND tablets = {{'enabled': false}}");
        if let Err(e) = session.query_unpaged(with_tablets_off, ()).await {
            if !e.to_string().to_lowercase().contains("tablets") {
                return Err(db_error("create keyspace", e));
            }
            session
                .query_unpaged(create_keyspace, ())
                .await
                .map_err(|e| db_error("create keyspace", e))?;
        }
    } else {
        session
            .query_unpaged(create_keyspace, ())
            .await
            .map_err(|e| db_error("create keyspace", e))?;
    }
    // Made before keys were kept per conversation: its messages' keys are
    // in `messages_by_key` alone, and a resend of one must still find it.
    // (A migration cut off before it recorded the layout is taken for an
    // upgrade: the old key table is read for nothing until the horizon.)
    let upgraded_from_global_keys = table_exists(session, ks, "messages_by_key").await?
        && !layout_recorded(session, ks).await?;
    let tables = [
        format!(
            "CREATE TABLE IF NOT EXISTS {ks}.messages_by_key (
                sender text, client_msg_id blob,
                conversation text, seq bigint, server_id bigint, body text, stored_at_ms bigint,
                PRIMARY KEY ((sender, client_msg_id)))"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {ks}.messages_by_conversation (
                conversation text, seq bigint,
                sender text, client_msg_id blob, server_id bigint, body text, stored_at_ms bigint,
                pending boolean, committed boolean, abandoned boolean,
                last_seq bigint static,
                PRIMARY KEY ((conversation), seq))
             WITH CLUSTERING ORDER BY (seq ASC)"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {ks}.layout_changes (
                name text PRIMARY KEY, since_ms bigint)"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {ks}.leases (
                scope text, name text, next_free bigint, owner text,
                PRIMARY KEY ((scope, name)))"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {ks}.members (
                instance text PRIMARY KEY, name text, until_ms bigint)"
        ),
    ];
    for statement in tables {
        session
            .query_unpaged(statement, ())
            .await
            .map_err(|e| db_error("create table", e))?;
    }
    // Columns added since the first release, on keyspaces made before them.
    add_missing_columns(
        session,
        ks,
        "messages_by_conversation",
        &[
            ("pending", "boolean"),
            ("committed", "boolean"),
            ("abandoned", "boolean"),
            ("key_seq", "bigint"),
            ("fingerprint", "bigint"),
            // The seq of the conversation's last message, which each
            // insert's batch moves on under a condition.
            ("last_seq", "bigint static"),
        ],
    )
    .await?;
    add_missing_columns(session, ks, "leases", &[("owner", "text")]).await?;
    // When keys moved into their conversations' partitions: 0 on a keyspace
    // that never had them elsewhere. Written once; a later migration keeps
    // the first answer.
    let since_ms = if upgraded_from_global_keys {
        super::unix_millis()
    } else {
        0
    };
    session
        .query_unpaged(
            format!("INSERT INTO {ks}.layout_changes (name, since_ms) VALUES (?, ?) IF NOT EXISTS"),
            (CONVERSATION_KEYS, since_ms),
        )
        .await
        .map_err(|e| db_error("record the layout", e))?;
    session
        .await_schema_agreement()
        .await
        .map_err(|e| db_error("schema agreement", e))?;
    Ok(())
}

/// The `layout_changes` row that says since when keys are kept per
/// conversation.
pub(super) const CONVERSATION_KEYS: &str = "conversation_keys";

/// Whether `table` exists in keyspace `ks`.
async fn table_exists(session: &Session, ks: &str, table: &str) -> Result<bool, Error> {
    let result = session
        .query_unpaged(
            "SELECT table_name FROM system_schema.tables \
             WHERE keyspace_name = ? AND table_name = ?",
            (ks, table),
        )
        .await
        .map_err(|e| db_error("read schema", e))?;
    Ok(!rows::<(String,)>(result)?.is_empty())
}

/// Whether the migration has recorded since when keys are kept per
/// conversation.
async fn layout_recorded(session: &Session, ks: &str) -> Result<bool, Error> {
    if !table_exists(session, ks, "layout_changes").await? {
        return Ok(false);
    }
    let result = session
        .query_unpaged(
            format!("SELECT since_ms FROM {ks}.layout_changes WHERE name = ?"),
            (CONVERSATION_KEYS,),
        )
        .await
        .map_err(|e| db_error("read the layout", e))?;
    Ok(!rows::<(i64,)>(result)?.is_empty())
}

/// Add the columns `table` lacks (ScyllaDB has no `ADD IF NOT EXISTS`).
async fn add_missing_columns(
    session: &Session,
    ks: &str,
    table: &str,
    columns: &[(&str, &str)],
) -> Result<(), Error> {
    let result = session
        .query_unpaged(
            "SELECT column_name FROM system_schema.columns \
             WHERE keyspace_name = ? AND table_name = ?",
            (ks, table),
        )
        .await
        .map_err(|e| db_error("read schema", e))?;
    let present: Vec<String> = rows::<(String,)>(result)?
        .into_iter()
        .map(|(name,)| name)
        .collect();
    for (name, kind) in columns {
        if !present.iter().any(|p| p == name) {
            session
                .query_unpaged(format!("ALTER TABLE {ks}.{table} ADD {name} {kind}"), ())
                .await
                .map_err(|e| db_error("add column", e))?;
        }
    }
    Ok(())
}
