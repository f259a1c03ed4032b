//! Following a Sentinel failover as the sentinels run it, for a `RedisStore` connected with a
//! `redis-sentinel://` URL.
//!
//! During a failover the old master may stay reachable and keep acknowledging writes: after the
//! sentinels promote a replica (`REPLICAOF NO ONE`) and until they demote the old master, seconds
//! later, everything written there is thrown away. Claims written there let a retry run a key
//! again. So the store listens to every sentinel:
//!
//! - `+failover-state-send-slaveof-noone` for its service (the leader has chosen the replica and
//!   promotes it at its next tick, ~100 ms later) *fences* the store: claims are refused (503),
//!   and completions, releases and renewals wait, until the failover ends;
//! - `+switch-master` for its service reconnects every client of the store to the new master,
//!   then lifts the fence. Every sentinel announces the switch, milliseconds apart: the leader
//!   first, the others once they hear of it from the leader. A reconnection on the leader's
//!   announcement can ask a sentinel that has not heard yet (seen here up to 16 ms after the
//!   leader's announcement reached a subscriber), which names the old master, still taking
//!   writes. So each reconnection is checked: until every client is on the announced master, it
//!   is tried again ([`FOLLOW_ATTEMPTS`]), and the other sentinels' announcements of a switch not
//!   followed yet are acted on too;
//! - a `-failover-abort-*` event for its service lifts the fence, and so does the end of
//!   [`FENCE_LIMIT`], in case the end of the failover went unseen.
//!
//! The watch is only as good as its subscriptions, which sit idle between failovers and can die
//! without a word. Each is pinged by a heartbeat (`liveness`) and replaced when silent.
//! While no sentinel can be heard (every subscription silent or disconnected) the store is
//! *blind*: a failover would go unseen, so claims are refused (503, counted `fenced`) until one
//! subscription is back; owners' writes go on (they check their ownership in the script). When
//! the watch sees again, every client is reconnected once, so that a switch made during the gap
//! is followed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::types::config::{Config, ReconnectPolicy, Server, ServerConfig};
use fred::types::Builder;
use tokio::sync::Notify;

use super::connection::Quit;
use super::liveness::{self, Heartbeat, Pace, Watched};
use crate::telemetry::{self, Connection as Role, ConnectionEvent};

const SWITCH_MASTER: &str = "+switch-master";
const PROMOTING: &str = "+failover-state-send-slaveof-noone";
const ABORTED: &str = "-failover-abort-*";
/// The longest a fence stays up without the failover's end being seen.
const FENCE_LIMIT: Duration = Duration::from_secs(10);
/// How many times one `+switch-master` reconnects the store's clients, a pause apart, until all
/// are on the master it announced.
const FOLLOW_ATTEMPTS: u32 = 20;
const FOLLOW_PAUSE: Duration = Duration::from_millis(50);

/// Raised while the sentinels fail the master over; see the module docs.
#[derive(Default)]
pub(super) struct Fence {
    raised: AtomicBool,
    lowered: Notify,
    /// No sentinel can be heard: a failover would go unseen. Claims are refused meanwhile.
    blind: AtomicBool,
}

impl Fence {
    pub(super) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// Whether no sentinel can be heard (claims are refused).
    pub(super) fn is_blind(&self) -> bool {
        self.blind.load(Ordering::Acquire)
    }

    /// Returns once the fence is down (at once, almost always).
    pub(super) async fn until_lowered(&self) {
        while self.is_raised() {
            let lowered = self.lowered.notified();
            if !self.is_raised() {
                return;
            }
            lowered.await;
        }
    }

    fn raise(&self) {
        self.raised.store(true, Ordering::Release);
    }

    fn lower(&self) {
        self.raised.store(false, Ordering::Release);
        self.lowered.notify_waiters();
    }
}

/// The sentinel subscriptions of a store; stopped, and their connections closed, with the last
/// store clone.
pub(super) struct SwitchWatch {
    task: tokio::task::JoinHandle<()>,
    /// Watches the subscriptions' heartbeat and makes the store blind while none is heard.
    sight: tokio::task::JoinHandle<()>,
    _subscribers: Vec<Quit>,
    /// The clients to reconnect on a switch: the store's, and those of its waiting calls.
    targets: Arc<Mutex<Vec<Client>>>,
    pub(super) fence: Arc<Fence>,
}

impl Drop for SwitchWatch {
    fn drop(&mut self) {
        self.task.abort();
        self.sight.abort();
        // The subscribers quit when the `Quit` field is dropped, after this.
    }
}

impl SwitchWatch {
    /// Reconnects `clients` too on every switch.
    pub(super) fn also_reconnect(&self, clients: Vec<Client>) {
        if let Ok(mut targets) = self.targets.lock() {
            targets.extend(clients);
        }
    }
}

/// For a client configured with Sentinel, subscribes to the failover events on each sentinel it
/// knows (`None` for other clients).
pub(super) async fn watch(
    client: &Client,
    policy: ReconnectPolicy,
    pace: Arc<Pace>,
) -> Result<Option<SwitchWatch>, fred::error::Error> {
    let config = client.client_config();
    let ServerConfig::Sentinel {
        hosts,
        service_name,
        username,
        password,
    } = &config.server
    else {
        return Ok(None);
    };
    let mut subscribers = Vec::with_capacity(hosts.len());
    for sentinel in hosts {
        let sentinel_config = Config {
            server: ServerConfig::Centralized {
                server: sentinel.clone(),
            },
            username: username.clone(),
            password: password.clone(),
            #[cfg(feature = "tls")]
            tls: config.tls.clone(),
            ..Config::default()
        };
        let subscriber = Builder::from_config(sentinel_config)
            .set_connection_config(liveness::connection_config(client))
            .set_policy(policy.clone())
            .build()?;
        subscribers.push(subscriber);
    }
    let targets = Arc::new(Mutex::new(vec![client.clone()]));
    let fence = Arc::new(Fence::default());
    let task = tokio::spawn(follow(
        targets.clone(),
        fence.clone(),
        subscribers.clone(),
        service_name.clone(),
    ));
    let sight = tokio::spawn(keep_sight(
        targets.clone(),
        fence.clone(),
        subscribers.clone(),
        pace,
    ));
    Ok(Some(SwitchWatch {
        task,
        sight,
        _subscribers: subscribers.into_iter().map(Quit).collect(),
        targets,
        fence,
    }))
}

/// Pings the sentinel subscriptions and keeps the fence's `blind` flag: raised while none of them
/// is heard, lowered (after reconnecting every client once) when one is again.
async fn keep_sight(
    targets: Arc<Mutex<Vec<Client>>>,
    fence: Arc<Fence>,
    subscribers: Vec<Client>,
    pace: Arc<Pace>,
) {
    let heartbeat = Heartbeat::start(Role::Sentinels, Watched::Shared(subscribers.clone()), pace);
    let mut ticks = tokio::time::interval(liveness::DEFAULT_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The subscribers connect in `follow`'s listeners: give them a beat before judging.
    ticks.tick().await;
    loop {
        ticks.tick().await;
        // With the heartbeat off, a silent subscription goes unseen: only one that fred knows to
        // be down counts.
        let heard = (subscribers.iter().enumerate())
            .any(|(index, subscriber)| subscriber.is_connected() && !heartbeat.is_silent(index));
        let blind = fence.blind.load(Ordering::Acquire);
        if !heard && !blind {
            tracing::warn!(
                "no sentinel can be heard (every subscription is silent or down): a failover would go \
                 unseen, so claims are refused until one is back"
            );
            telemetry::connection_event(Role::Sentinels, ConnectionEvent::FeedLost);
            fence.blind.store(true, Ordering::Release);
        } else if heard && blind {
            // The master may have been switched while nobody heard: go where the sentinels
            // say the master is now, then take claims again.
            let clients = targets.lock().map(|clients| clients.clone()).unwrap_or_default();
            futures_util::future::join_all(clients.iter().map(reconnect)).await;
            tracing::info!(
                "a sentinel is heard again; the store reconnected to the master it names and takes claims"
            );
            telemetry::connection_event(Role::Sentinels, ConnectionEvent::FeedBack);
            fence.blind.store(false, Ordering::Release);
        }
    }
}

/// What a sentinel announced about some service.
enum Event {
    Promoting(String),
    Switched(String),
    Aborted(String),
}

impl Event {
    /// The service an event's text names: `+switch-master` starts with it; the others describe
    /// an instance, `<kind> <name> <ip> <port>`, followed for a replica by `@ <service> <ip>
    /// <port>`.
    fn names(&self, service: &str) -> bool {
        match self {
            Event::Switched(text) => text.split(' ').next() == Some(service),
            Event::Promoting(text) | Event::Aborted(text) => {
                let master = match text.split_once(" @ ") {
                    Some((_, master)) => master,
                    None => text.split_once(' ').map_or("", |(_, rest)| rest),
                };
                master.split(' ').next() == Some(service)
            }
        }
    }
}

/// Listens on every sentinel and acts on each event for `service`: on the promotion (the leader
/// alone announces it), on an abort, and on a switch until the store has followed it (every
/// sentinel announces a switch).
async fn follow(
    targets: Arc<Mutex<Vec<Client>>>,
    fence: Arc<Fence>,
    subscribers: Vec<Client>,
    service: String,
) {
    use tokio::sync::broadcast::error::RecvError;

    let (events, mut announced) = tokio::sync::mpsc::unbounded_channel();
    let mut listeners = Vec::with_capacity(subscribers.len());
    for subscriber in subscribers {
        let events = events.clone();
        listeners.push(tokio::spawn(async move {
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
                            let _ = events.send(event);
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
                        if let Err(error) = subscribed.await {
                            tracing::warn!(%error, "cannot subscribe to the failover events of a sentinel");
                        }
                    }
                }
            }
        }));
    }
    drop(events);
    // Aborted with this task, since they hold the channel's senders.
    struct AbortOnDrop(Vec<tokio::task::JoinHandle<()>>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.iter().for_each(tokio::task::JoinHandle::abort);
        }
    }
    let _listeners = AbortOnDrop(listeners);
    let mut followed = String::new();
    // When a raised fence comes down by itself: FENCE_LIMIT after it was raised, however many
    // events (of other services, say) arrive meanwhile.
    let mut fence_ends: Option<tokio::time::Instant> = None;
    loop {
        let next = if fence.is_raised() {
            let ends = *fence_ends.get_or_insert_with(|| tokio::time::Instant::now() + FENCE_LIMIT);
            match tokio::time::timeout_at(ends, announced.recv()).await {
                Ok(event) => event,
                Err(_) => {
                    tracing::warn!(
                        "a failover began {FENCE_LIMIT:?} ago and its end went unseen; taking writes again"
                    );
                    fence.lower();
                    continue;
                }
            }
        } else {
            fence_ends = None;
            announced.recv().await
        };
        let Some(event) = next else { return };
        if !event.names(&service) {
            continue;
        }
        match event {
            Event::Promoting(text) => {
                tracing::info!(replica = %text, "the sentinels are promoting a replica; refusing new claims until the switch");
                fence.raise();
            }
            Event::Aborted(text) => {
                if fence.is_raised() {
                    tracing::info!(%text, "the sentinels aborted the failover; taking writes again");
                    fence.lower();
                }
            }
            // "<service> <old ip> <old port> <new ip> <new port>", from every sentinel.
            Event::Switched(switch) if switch != followed => {
                tracing::info!(%switch, "the sentinels switched the master; reconnecting to the new one");
                let clients = targets.lock().map(|clients| clients.clone()).unwrap_or_default();
                let master = announced_master(&switch);
                for attempt in 0..FOLLOW_ATTEMPTS {
                    if attempt > 0 {
                        tokio::time::sleep(FOLLOW_PAUSE).await;
                    }
                    let landed = futures_util::future::join_all(clients.iter().map(reconnect)).await;
                    let on_master = |server: &Option<Server>| {
                        (server.as_ref().zip(master)).is_some_and(|(server, (host, port))| {
                            &*server.host == host && server.port == port
                        })
                    };
                    if landed.iter().all(on_master) {
                        followed.clone_from(&switch);
                        break;
                    }
                    if master.is_none() {
                        break; // no address to check against: reconnected once
                    }
                }
                if followed != switch {
                    tracing::warn!(
                        %switch,
                        "after {FOLLOW_ATTEMPTS} reconnections the store is not on the announced master; it \
                         tries again on the next +switch-master, or when the old master refuses a write (READONLY)"
                    );
                }
                fence.lower();
            }
            Event::Switched(_) => {}
        }
    }
}

/// The new master a `+switch-master` names: `<service> <old ip> <old port> <new ip> <new port>`.
fn announced_master(switch: &str) -> Option<(&str, u16)> {
    let fields: Vec<&str> = switch.split(' ').collect();
    let [_, _, _, host, port] = fields[..] else {
        return None;
    };
    Some((host, port.parse().ok()?))
}

/// Reconnects `client` (fred asks a sentinel for the master) and returns the server it
/// connected to, as its reconnection event tells (`None` if the reconnection failed).
async fn reconnect(client: &Client) -> Option<Server> {
    use tokio::sync::broadcast::error::TryRecvError;

    let mut reconnections = client.reconnect_rx();
    if let Err(error) = client.force_reconnection().await {
        tracing::warn!(%error, "reconnecting after +switch-master failed; the reconnect policy retries");
        return None;
    }
    // fred announces the reconnection before it answers `force_reconnection`.
    let mut landed = None;
    loop {
        match reconnections.try_recv() {
            Ok(server) => landed = Some(server),
            Err(TryRecvError::Lagged(_)) => {}
            Err(TryRecvError::Empty | TryRecvError::Closed) => return landed,
        }
    }
}

/// A fence a test raises and lowers itself, in a watch that follows no sentinel: the store's
/// completions, renewals and claims meet it as they meet the one a failover raises.
#[cfg(test)]
pub(super) fn held_by_test() -> (SwitchWatch, Arc<Fence>) {
    let fence = Arc::new(Fence::default());
    let watch = SwitchWatch {
        task: tokio::spawn(async {}),
        sight: tokio::spawn(async {}),
        _subscribers: Vec::new(),
        targets: Arc::default(),
        fence: fence.clone(),
    };
    (watch, fence)
}

#[cfg(test)]
impl Fence {
    pub(super) fn set_raised_by_test(&self, raised: bool) {
        if raised {
            self.raise();
        } else {
            self.lower();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::{announced_master, Event, Fence};

    #[tokio::test]
    async fn writes_held_at_a_raised_fence_go_on_when_it_is_lowered() {
        let fence = Arc::new(Fence::default());
        fence.until_lowered().await; // down: at once
        fence.raise();
        let held = tokio::spawn({
            let fence = fence.clone();
            async move { fence.until_lowered().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!held.is_finished(), "a write went through a raised fence");
        fence.lower();
        tokio::time::timeout(Duration::from_secs(1), held)
            .await
            .expect("lowering the fence releases the held write")
            .unwrap();
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
        assert_eq!(announced_master(switch), Some(("10.0.0.2", 7001)));
        assert_eq!(announced_master("main 127.0.0.1 7000"), None);
        assert_eq!(announced_master("main 127.0.0.1 7000 10.0.0.2 port"), None);
    }
}
