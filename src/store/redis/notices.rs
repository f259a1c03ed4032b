//! Notices of settled records, for requests that wait for a running one ([`Store::watch`] on
//! Redis).
//!
//! The scripts that complete, release and purge a record publish an empty message on the
//! record's own shard channel, `<record key>:settled` (`SPUBLISH`: on a Cluster the message
//! stays on the shard of the record's slot instead of being broadcast to every node; the
//! channel carries the record's hash tag, so it is in that slot): a purge always, a completion
//! or release only when a waiter has marked the record (each of a waiter's reads marks it, in
//! one step: `Store::claim_waiting`, `wait.lua`; the mark is in `record`), so a record nobody
//! waits for costs no notice. A store subscribes
//! (`SSUBSCRIBE`) to the channels of the keys its waiters wait on, on one connection of its own
//! opened with the first waiter: waiting never blocks the connection other requests share, and
//! a thousand waiters cost one connection and, per key, one subscription.
//!
//! [`Store::watch`]: crate::Store::watch

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::types::config::ReconnectPolicy;
use fred::types::Builder;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::connection::{unavailable, Quit};
use super::liveness::{self, Heartbeat, Pace, Watched};
use crate::store::contract::KeyWatch;
use crate::store::error::StoreError;
use crate::sync::lock;
use crate::telemetry::Connection as Role;

/// The channel a record's settling is published on; `complete.lua`, `release.lua` and
/// `purge.lua` name it the same way.
pub(super) fn settled_channel(redis_key: &str) -> String {
    let mut channel = String::with_capacity(redis_key.len() + 8);
    channel.push_str(redis_key);
    channel.push_str(":settled");
    channel
}

/// One store's subscriber connection and the subscriptions of its waiters; its tasks stop when
/// the last clone of the store is dropped.
pub(super) struct Notices {
    registry: Arc<Registry>,
    commands: mpsc::UnboundedSender<Command>,
    tasks: [JoinHandle<()>; 2],
    _heartbeat: Heartbeat,
    client: Quit,
}

impl Drop for Notices {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        // The client quits when the `Quit` field is dropped, after this.
    }
}

/// The channels subscribed to, each shared by the waiters on its key.
#[derive(Default)]
struct Registry {
    channels: Mutex<HashMap<String, Arc<Channel>>>,
}

struct Channel {
    name: String,
    /// Bumped on every message (and whenever one may have been missed): what waiters wait on.
    changes: watch::Sender<u64>,
    /// Whether the subscription is in place yet.
    state: watch::Sender<Subscription>,
    /// The waiters holding it; changed only under the registry's lock.
    waiters: AtomicUsize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Subscription {
    Pending,
    Live,
    Failed,
}

/// What the subscriber connection is asked to do, in order: a subscription and the
/// unsubscription of the same channel must reach Redis in the order they were decided.
enum Command {
    Subscribe(Arc<Channel>),
    Unsubscribe(String),
    /// The connection came back: subscribe to every channel again, then wake every waiter (a
    /// notice sent meanwhile was lost; they read their records again).
    Resubscribe,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Channel>>> {
        // Every update is one insert or remove: the map behind a poisoned lock is sound.
        lock(&self.channels)
    }

    fn wake(&self, name: &str) {
        if let Some(channel) = self.lock().get(name) {
            channel.changes.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    fn wake_all(&self) {
        for channel in self.lock().values() {
            channel.changes.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}

/// Ends a waiter's hold on its channel; the last one out unsubscribes.
struct Unwatch {
    registry: Arc<Registry>,
    channel: Arc<Channel>,
    commands: mpsc::UnboundedSender<Command>,
}

impl Drop for Unwatch {
    fn drop(&mut self) {
        let mut channels = self.registry.lock();
        if self.channel.waiters.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let current = channels
            .get(&self.channel.name)
            .is_some_and(|held| Arc::ptr_eq(held, &self.channel));
        if current {
            channels.remove(&self.channel.name);
            // Queued under the lock, so it reaches Redis before any later subscription to the
            // same channel.
            let _ = self
                .commands
                .send(Command::Unsubscribe(self.channel.name.clone()));
        }
    }
}

impl Notices {
    /// Opens the subscriber connection: `base`'s settings, with a reconnect policy even when
    /// `base` has none.
    pub(super) async fn connect(
        base: &Client,
        policy: ReconnectPolicy,
        timeout: Duration,
        pace: Arc<Pace>,
    ) -> Result<Self, StoreError> {
        let client = Builder::from_config(base.client_config())
            .set_connection_config(liveness::connection_config(base))
            .set_performance_config(base.perf_config())
            .set_policy(base.client_reconnect_policy().unwrap_or(policy))
            .build()
            .map_err(unavailable)?;
        client.init().await.map_err(unavailable)?;
        let registry = Arc::new(Registry::default());
        let (commands, queue) = mpsc::unbounded_channel();
        let heartbeat = Heartbeat::start(Role::Notices, Watched::Shared(vec![client.clone()]), pace);
        let tasks = [
            tokio::spawn(run_commands(client.clone(), registry.clone(), queue, timeout)),
            tokio::spawn(listen(
                client.clone(),
                registry.clone(),
                commands.clone(),
                heartbeat.silences(),
            )),
        ];
        Ok(Self {
            registry,
            commands,
            tasks,
            _heartbeat: heartbeat,
            client: Quit(client),
        })
    }

    /// The subscriber connection, for a Sentinel store's failover watch to reconnect.
    pub(super) fn client(&self) -> &Client {
        &self.client.0
    }

    /// A watch of `channel`, answered once the subscription is in place (within `timeout`).
    pub(super) async fn watch(&self, channel: String, timeout: Duration) -> Result<KeyWatch, StoreError> {
        let (held, changes) = {
            let mut channels = self.registry.lock();
            let reusable = channels
                .get(&channel)
                .filter(|held| *held.state.borrow() != Subscription::Failed)
                .cloned();
            let held = match reusable {
                Some(held) => held,
                None => {
                    let fresh = Arc::new(Channel {
                        name: channel.clone(),
                        changes: watch::channel(0).0,
                        state: watch::channel(Subscription::Pending).0,
                        waiters: AtomicUsize::new(0),
                    });
                    channels.insert(channel, fresh.clone());
                    let _ = self.commands.send(Command::Subscribe(fresh.clone()));
                    fresh
                }
            };
            held.waiters.fetch_add(1, Ordering::AcqRel);
            // Made before the subscription is confirmed: a notice that arrives between the
            // confirmation and the caller's wait is still seen.
            let changes = held.changes.subscribe();
            (held, changes)
        };
        let mut state = held.state.subscribe();
        let unwatch = Unwatch {
            registry: self.registry.clone(),
            channel: held,
            commands: self.commands.clone(),
        };
        let settled = tokio::time::timeout(timeout, state.wait_for(|s| *s != Subscription::Pending))
            .await
            .map(|state| state.map(|state| *state));
        match settled {
            Ok(Ok(Subscription::Live)) => Ok(KeyWatch::new(changes, unwatch)),
            Ok(_) => Err(StoreError::Unavailable(
                "could not subscribe to the notices of a running request".into(),
            )),
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }
}

/// Sends the subscriptions and unsubscriptions in the order they were decided.
async fn run_commands(
    client: Client,
    registry: Arc<Registry>,
    mut queue: mpsc::UnboundedReceiver<Command>,
    timeout: Duration,
) {
    while let Some(command) = queue.recv().await {
        match command {
            Command::Subscribe(channel) => {
                let subscribed = tokio::time::timeout(timeout, client.ssubscribe(channel.name.clone())).await;
                let state = match subscribed {
                    Ok(Ok(())) => Subscription::Live,
                    Ok(Err(error)) => {
                        tracing::warn!(%error, "could not subscribe to the notices of a running request; its waiters get 409");
                        Subscription::Failed
                    }
                    Err(_) => Subscription::Failed,
                };
                channel.state.send_replace(state);
            }
            Command::Unsubscribe(name) => {
                if let Ok(Err(error)) = tokio::time::timeout(timeout, client.sunsubscribe(name)).await {
                    tracing::debug!(%error, "could not unsubscribe from a settled key's notices");
                }
            }
            Command::Resubscribe => {
                let live: Vec<String> = (registry.lock().values())
                    .filter(|channel| *channel.state.borrow() == Subscription::Live)
                    .map(|channel| channel.name.clone())
                    .collect();
                for name in live {
                    // On a Cluster each channel may be on another shard: one command each.
                    if let Ok(Err(error)) = tokio::time::timeout(timeout, client.ssubscribe(name)).await {
                        tracing::warn!(%error, "could not subscribe again to the notices of a running request; its waiters wait for their lease or deadline");
                    }
                }
                registry.wake_all();
            }
        }
    }
}

/// Wakes the waiters of each channel a notice arrives on, and every waiter when notices may have
/// been missed: the connection went silent (found by its heartbeat) or came back. A woken waiter
/// reads its record, so while notices cannot arrive, waiters still learn of a settled record.
async fn listen(
    client: Client,
    registry: Arc<Registry>,
    commands: mpsc::UnboundedSender<Command>,
    mut silences: watch::Receiver<u64>,
) {
    use tokio::sync::broadcast::error::RecvError;

    let mut messages = client.message_rx();
    let mut reconnects = client.reconnect_rx();
    loop {
        tokio::select! {
            message = messages.recv() => match message {
                Ok(message) => registry.wake(&message.channel),
                // Notices were dropped: whoever they were for reads its record again.
                Err(RecvError::Lagged(_)) => registry.wake_all(),
                Err(RecvError::Closed) => return,
            },
            reconnect = reconnects.recv() => match reconnect {
                Ok(_) | Err(RecvError::Lagged(_)) => {
                    let _ = commands.send(Command::Resubscribe);
                }
                Err(RecvError::Closed) => return,
            },
            silenced = silences.changed() => match silenced {
                Ok(()) => registry.wake_all(),
                Err(_) => return,
            },
        }
    }
}
