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
                PRIMARY KEY ((conversation), seq))
             WITH CLUSTERING ORDER BY (seq ASC)"
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
        ],
    )
    .await?;
    add_missing_columns(session, ks, "leases", &[("owner", "text")]).await?;
    session
        .await_schema_agreement()
        .await
        .map_err(|e| db_error("schema agreement", e))?;
    Ok(())
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
