//! The sentinels' announcements: what each subscription hears, and what a switch or a promotion
//! names.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use fred::clients::Client;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use tokio::time::Instant;

pub(super) const SWITCH_MASTER: &str = "+switch-master";
pub(super) const PROMOTING: &str = "+failover-state-send-slaveof-noone";
pub(super) const ABORTED: &str = "-failover-abort-*";

/// What a sentinel announced, and when the watch received it.
pub(super) struct Announcement {
    pub(super) event: Event,
    pub(super) received: Instant,
}

/// What a sentinel announced about some service.
pub(super) enum Event {
    Promoting(String),
    Switched(String),
    Aborted(String),
}

impl Event {
    /// The service an event's text names: `+switch-master` starts with it; the others describe
    /// an instance, `<kind> <name> <ip> <port>`, followed for a replica by `@ <service> <ip>
    /// <port>`.
    pub(super) fn names(&self, service: &str) -> bool {
        match self {
            Event::Switched(text) => text.split(' ').next() == Some(service),
            Event::Promoting(text) | Event::Aborted(text) => {
                let master = text.split_once(" @ ").or_else(|| text.split_once(' '));
                let master = master.map_or("", |(_, master)| master);
                master.split(' ').next() == Some(service)
            }
        }
    }
}

/// A master's address as the sentinels give it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Address {
    pub(super) host: String,
    pub(super) port: u16,
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Listens on one sentinel and hands its events for any service to the watch.
pub(super) async fn listen(
    subscriber: Client,
    events: tokio::sync::mpsc::UnboundedSender<Announcement>,
    subscribed_count: Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::sync::broadcast::error::RecvError;

    let mut counted = false;
    let mut messages = subscriber.message_rx();
    let mut reconnects = subscriber.reconnect_rx();
    // Connected only now that its first connection cannot go unseen. A sentinel that is
    // down is subscribed to when it is back (the reconnect policy retries forever); the
    // others carry the announcements meanwhile.
    let _connection_task = subscriber.connect();
    loop {
        tokio::select! {
            message = messages.recv() => match message {
                Ok(message) => {
                    let Some(text) = message.value.as_string() else { continue };
                    let event = match &*message.channel {
                        SWITCH_MASTER => Event::Switched(text),
                        PROMOTING => Event::Promoting(text),
                        channel if channel.starts_with("-failover-abort-") => Event::Aborted(text),
                        _ => continue,
                    };
                    let _ = events.send(Announcement {
                        event,
                        received: Instant::now(),
                    });
                }
                Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => return,
            },
            // Also the first connection: subscriptions are (re)made on every connect.
            _ = reconnects.recv() => {
                let subscribed = async {
                    subscriber.subscribe(vec![SWITCH_MASTER, PROMOTING]).await?;
                    subscriber.psubscribe(ABORTED).await
                };
                match subscribed.await {
                    Ok(()) if !counted => {
                        counted = true;
                        subscribed_count.fetch_add(1, Ordering::AcqRel);
                    }
                    Ok(()) => {}
                    Err(error) => tracing::warn!(%error, "cannot subscribe to the failover events of a sentinel"),
                }
            }
        }
    }
}

/// The new master a `+switch-master` names: `<service> <old ip> <old port> <new ip> <new port>`.
pub(super) fn announced_master(switch: &str) -> Option<Address> {
    address_in(switch, 5, 3)
}

/// The old master a `+switch-master` names.
pub(super) fn announced_old(switch: &str) -> Option<Address> {
    address_in(switch, 5, 1)
}

/// The master a promotion event names: `slave <name> <ip> <port> @ <service> <ip> <port>`.
pub(super) fn announced_old_master(promoting: &str) -> Option<Address> {
    let (_, master) = promoting.split_once(" @ ")?;
    address_in(master, 3, 1)
}

/// The address at fields `at` (the host) and `at + 1` (the port) of `text`, which must have
/// exactly `count` fields, separated by single spaces.
fn address_in(text: &str, count: usize, at: usize) -> Option<Address> {
    let fields: Vec<&str> = text.split(' ').collect();
    if fields.len() != count {
        return None;
    }
    Some(Address {
        host: fields[at].to_owned(),
        port: fields[at + 1].parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::{announced_master, announced_old, announced_old_master, Address, Event};

    fn address(host: &str, port: u16) -> Option<Address> {
        Some(Address {
            host: host.to_owned(),
            port,
        })
    }

    #[test]
    fn events_are_matched_to_their_service() {
        let promoting = Event::Promoting("slave 127.0.0.1:7001 127.0.0.1 7001 @ main 127.0.0.1 7000".into());
        assert!(promoting.names("main"));
        assert!(!promoting.names("other"));
        let aborted = Event::Aborted("master main 127.0.0.1 7000".into());
        assert!(aborted.names("main"));
        assert!(!aborted.names("127.0.0.1"));
        let switched = Event::Switched("main 127.0.0.1 7000 127.0.0.1 7001".into());
        assert!(switched.names("main"));
        assert!(!switched.names("mai"));
    }

    #[test]
    fn a_switch_names_the_new_master() {
        let switch = "main 127.0.0.1 7000 10.0.0.2 7001";
        assert_eq!(announced_master(switch), address("10.0.0.2", 7001));
        assert_eq!(announced_old(switch), address("127.0.0.1", 7000));
        assert_eq!(announced_master("main 127.0.0.1 7000"), None);
        assert_eq!(announced_master("main 127.0.0.1 7000 10.0.0.2 port"), None);
    }

    #[test]
    fn a_promotion_names_the_master_it_leaves() {
        let promoting = "slave 127.0.0.1:7001 127.0.0.1 7001 @ main 127.0.0.1 7000";
        assert_eq!(announced_old_master(promoting), address("127.0.0.1", 7000));
        assert_eq!(announced_old_master("master main 127.0.0.1 7000"), None);
    }
}
