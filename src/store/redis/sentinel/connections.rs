//! The watch's own connections: to each sentinel (built like the store's), and a one-off one to
//! a master it must question; and how the store's clients are moved.

use fred::clients::Client;
use fred::interfaces::ClientLike;
use std::time::Duration;

use fred::types::config::{Config, ConnectionConfig, ReconnectPolicy, Server, ServerConfig};
use fred::types::{Builder, ClusterHash, CustomCommand, Value};

use super::super::connection::Quit;
use super::events::Address;

/// The bound on one question to a sentinel (`SENTINEL MASTER`) or to the master (`ROLE`).
pub(super) const ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// A sentinel the others told of: its subscriber, and a plain connection that asks it what it
/// names and which others it knows (both quit, and its listener stopped, when dropped).
pub(super) struct Discovered {
    pub(super) address: (String, u16),
    pub(super) listener: tokio::task::JoinHandle<()>,
    pub(super) subscriber: Quit,
    pub(super) asker: Quit,
}

impl Drop for Discovered {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

/// Builds the watch's connections to sentinels: the URL's credentials for the sentinels, its
/// TLS, the store's connection settings and reconnect policy.
pub(super) struct SentinelClients {
    pub(super) template: Config,
    pub(super) connection: ConnectionConfig,
    pub(super) policy: ReconnectPolicy,
}

impl SentinelClients {
    pub(super) fn build(&self, sentinel: Server) -> Result<Client, fred::error::Error> {
        let config = Config {
            server: ServerConfig::Centralized { server: sentinel },
            ..self.template.clone()
        };
        Builder::from_config(config)
            .set_connection_config(self.connection.clone())
            .set_policy(self.policy.clone())
            .build()
    }
}

/// Whether the server at `address` answers `ROLE` as a replica, asked on a connection of its
/// own (the store's clients are on the master: moving one would move its commands), with the
/// store's credentials and TLS (`store`'s) and connection settings. `false` when it answers
/// anything else or nothing within [`ASK_TIMEOUT`]: only a replica is certain proof that a
/// switch to it was overtaken.
pub(super) async fn now_a_replica(store: &Client, connection: &ConnectionConfig, address: &Address) -> bool {
    let config = Config {
        server: ServerConfig::Centralized {
            server: Server::new(address.host.clone(), address.port),
        },
        ..store.client_config()
    };
    let Ok(client) = Builder::from_config(config)
        .set_connection_config(connection.clone())
        .build()
    else {
        return false;
    };
    let role = async {
        client.init().await?;
        let command = CustomCommand::new_static("ROLE", ClusterHash::Random, false);
        client.custom::<Value, Value>(command, vec![]).await
    };
    let answer = tokio::time::timeout(ASK_TIMEOUT, role).await;
    let _ = tokio::time::timeout(ASK_TIMEOUT, client.quit()).await;
    match answer {
        Ok(Ok(Value::Array(role))) => {
            matches!(
                role.first().and_then(Value::as_str).as_deref(),
                Some("slave" | "replica")
            )
        }
        _ => false,
    }
}

/// Whether `client` is connected to `master` (as the address it connected to says).
pub(super) fn is_on(client: &Client, master: &Address) -> bool {
    client.is_connected()
        && (client.active_connections().iter())
            .any(|server| *server.host == *master.host && server.port == master.port)
}

/// Reconnects `client`: fred asks a sentinel for the master and connects there.
pub(super) async fn reconnect(client: &Client) {
    if let Err(error) = client.force_reconnection().await {
        tracing::warn!(%error, "reconnecting to the master the sentinels name failed; the reconnect policy retries");
    }
}
