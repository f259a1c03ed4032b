//! Following a Sentinel failover as the sentinels run it, for a `RedisStore` connected with a
//! `redis-sentinel://` URL.
//!
//! During a failover the old master may stay reachable and keep acknowledging writes: after the
//! sentinels promote a replica (`REPLICAOF NO ONE`) and until they demote the old master, seconds
//! later, everything written there is thrown away. Claims written there let a retry run a key
//! again. So the store listens to every sentinel: those of its URL, and, when the URL names
//! fewer addresses than there are sentinels, those they know of (`SENTINEL SENTINELS`, asked
//! every [`DISCOVER_EVERY`] seconds, at their announced addresses), since only the failover's
//! leader announces a promotion and a URL may name one address for all of them (a Kubernetes
//! Service in front of the sentinels):
//!
//! - `+failover-state-send-slaveof-noone` for its service (the leader has chosen the replica and
//!   promotes it at its next tick, ~100 ms later) *fences* the store: claims are refused (503),
//!   and completions, releases and renewals wait, until the failover is over;
//! - `+switch-master` for its service reconnects the clients of the store that are not on the new
//!   master yet. Every sentinel announces the switch, milliseconds apart: the leader first, the
//!   others once they hear of it from the leader. A reconnection on the leader's announcement can
//!   ask a sentinel that has not heard yet (seen here up to 16 ms after the leader's announcement
//!   reached a subscriber), which names the old master, still taking writes. So each
//!   reconnection is checked: until every client is on the announced master, it is tried again
//!   ([`FOLLOW_ATTEMPTS`]), and the other sentinels' announcements of a switch not followed yet
//!   are acted on too;
//! - the fence comes down only once the new master is *confirmed*: every client of the store is
//!   connected to it and it answers `ROLE` as a master. Until then it stays up, however long:
//!   no timer lowers it (a promotion can wait for a slow replica, an election can be retried).
//!   While it stands, the sentinels are asked each second (`SENTINEL MASTER`) what they name, so
//!   a switch whose announcement went unheard is followed too; a failover the sentinels gave up
//!   (`-failover-abort-*`, or, unheard, nothing changed after twice their `failover-timeout`,
//!   the longest a failover can take, with its two timed phases) lowers it once the store is
//!   confirmed on the master they name. A fence that stands is logged every
//!   [`LONG_FENCE_REPORT`], and every claim it refuses is counted `fenced`;
//! - an announcement is news only once: a switch that came before the sentinels last answered
//!   that no failover is under way (it waited behind others), a switch whose new master is a replica
//!   by now (a sentinel's link to the store was slow), and the other sentinels' announcements of
//!   a switch already tried are not acted on. Acting on them fenced a store that was on the
//!   right master, and moved its clients back and forth, holding its owners' renewals past their
//!   leases (a 30-minute run of tests/history.rs, issue 36).
//!
//! The watch is only as good as its subscriptions, which sit idle between failovers and can die
//! without a word. Each is pinged by a heartbeat (`liveness`) and replaced when silent. While no
//! sentinel can be heard (every subscription silent or disconnected) a failover would go unseen.
//! But none can promote a replica before its master has been unreachable for
//! `down-after-milliseconds` (then they still need to agree and elect a leader), so a short
//! blindness costs nothing: the watch asks the sentinels each second (`SENTINEL MASTER`) for
//! `down-after-milliseconds`, when they last heard the master (`last-ok-ping-reply`) and whether
//! they think it down, and so knows the earliest moment a promotion could happen. Claims go on
//! while no sentinel is heard until that moment; from then on the store is *blind*: claims are
//! refused (503, counted `fenced`) until a subscription is back. A master the sentinels already
//! think down leaves no such margin, and neither does a `down-after-milliseconds` the watch could
//! not read (the sentinels do not answer `SENTINEL MASTER`: a renamed command, an ACL): then
//! claims are refused from the first missed ping, as if the sentinels could promote at once.
//! Owners' writes go on (they check their ownership in the script). When a subscription is heard
//! again, the sentinels are asked which master they name, and only the clients that are not on
//! it are reconnected (all of them if no sentinel answers).
//!
//! Not covered by the margin: an operator's `SENTINEL FAILOVER` promotes at once, without
//! waiting for `down-after-milliseconds`. Sent while this store hears no sentinel, it is followed
//! when a sentinel is heard again (or when the old master refuses a write, `READONLY`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::types::config::{Config, ReconnectPolicy, Server, ServerConfig};
use fred::types::{Builder, ClusterHash, CustomCommand, Value};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::connection::Quit;
use super::liveness::{self, Heartbeat, Pace, Watched};
use crate::telemetry::{self, Connection as Role, ConnectionEvent};

const SWITCH_MASTER: &str = "+switch-master";
const PROMOTING: &str = "+failover-state-send-slaveof-noone";
const ABORTED: &str = "-failover-abort-*";
/// How many times one attempt to follow a master reconnects the store's clients that are not on
/// it, a pause apart.
const FOLLOW_ATTEMPTS: u32 = 20;
const FOLLOW_PAUSE: Duration = Duration::from_millis(50);
/// The bound on one question to a sentinel (`SENTINEL MASTER`) or to the master (`ROLE`).
const ASK_TIMEOUT: Duration = Duration::from_secs(1);
/// Redis's own default `failover-timeout`, assumed while the sentinels' cannot be read.
const DEFAULT_FAILOVER_TIMEOUT: Duration = Duration::from_secs(180);
/// A failover ended with no switch only after twice the `failover-timeout` (the sentinels time
/// out the promotion and then the replicas' reconfiguration, each after one) and this much more:
/// the sentinels that did not lead it learn of its end from the leader's hello messages, sent
/// every 2 s.
const ENDED_MARGIN: Duration = Duration::from_secs(5);
/// How often (in looks, one a second) the watch asks the sentinels which others they know.
const DISCOVER_EVERY: u64 = 10;
/// How often a fence that stands is logged again.
const LONG_FENCE_REPORT: Duration = Duration::from_secs(30);
/// How long a new store waits for its subscriptions to the sentinels before it takes claims
/// without those not made yet (a sentinel down at the start is subscribed to when it is back;
/// the blind rule covers a store that hears none).
const START_BOUND: Duration = Duration::from_secs(5);

/// Raised while the sentinels fail the master over; see the module docs.
#[derive(Default)]
pub(super) struct Fence {
    raised: AtomicBool,
    lowered: Notify,
    /// No sentinel can be heard, and a failover could have promoted a replica since: claims are
    /// refused meanwhile.
    blind: AtomicBool,
    /// The watch listens: its first subscriptions are made, and the sentinels were asked
    /// whether a failover is under way. Until then a failover's announcement would go unheard
    /// (a store started in the second before one claimed on the old master, and keys ran twice:
    /// found by tests/history.rs), so claims wait.
    listening: AtomicBool,
}

impl Fence {
    pub(super) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// Whether no sentinel can be heard and a failover could be under way (claims are refused).
    pub(super) fn is_blind(&self) -> bool {
        self.blind.load(Ordering::Acquire)
    }

    /// Returns once the watch listens to the sentinels (at once, but in a new store's first
    /// moments).
    pub(super) async fn until_listening(&self) {
        while !self.listening.load(Ordering::Acquire) {
            let started = self.lowered.notified();
            if self.listening.load(Ordering::Acquire) {
                return;
            }
            started.await;
        }
    }

    fn start_listening(&self) {
        self.listening.store(true, Ordering::Release);
        self.lowered.notify_waiters();
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
    _subscribers: Vec<Quit>,
    /// One plain connection per sentinel, for `SENTINEL MASTER` (a subscribed connection takes
    /// no other command).
    _askers: Vec<Quit>,
    /// The clients to reconnect on a switch: the store's, and those of its waiting calls.
    targets: Arc<Mutex<Vec<Client>>>,
    pub(super) fence: Arc<Fence>,
}

impl Drop for SwitchWatch {
    fn drop(&mut self) {
        self.task.abort();
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
    let factory = SentinelClients {
        template: Config {
            username: username.clone(),
            password: password.clone(),
            #[cfg(feature = "tls")]
            tls: config.tls.clone(),
            ..Config::default()
        },
        connection: liveness::connection_config(client),
        policy,
    };
    let mut subscribers = Vec::with_capacity(hosts.len());
    let mut askers = Vec::with_capacity(hosts.len());
    for sentinel in hosts {
        subscribers.push(factory.build(sentinel.clone())?);
        let asker = factory.build(sentinel.clone())?;
        // Connected in the background: a sentinel that is down now is reached when it is back
        // (the reconnect policy retries forever), and is not asked meanwhile.
        let _connection_task = asker.connect();
        askers.push(asker);
    }
    let targets = Arc::new(Mutex::new(vec![client.clone()]));
    let fence = Arc::new(Fence::default());
    let (events, announced) = tokio::sync::mpsc::unbounded_channel::<Announcement>();
    let watcher = Watcher {
        subscribed: Arc::default(),
        targets: targets.clone(),
        fence: fence.clone(),
        subscribers: subscribers.clone(),
        askers: askers.clone(),
        service: service_name.clone(),
        promotable_from: None,
        failover_timeout: None,
        known_epoch: 0,
        heard: true,
        fenced: None,
        followed: String::new(),
        switch_seen: String::new(),
        attempted: String::new(),
        confirmed_at: None,
        url_subscribers: subscribers.clone(),
        url_addresses: hosts
            .iter()
            .map(|server| (server.host.to_string(), server.port))
            .collect(),
        factory,
        events,
        listeners: Vec::new(),
        discovered: Vec::new(),
        heartbeat: None,
        pace,
        looks: 0,
        discovered_once: false,
    };
    let task = tokio::spawn(watcher.run(announced));
    Ok(Some(SwitchWatch {
        task,
        _subscribers: subscribers.into_iter().map(Quit).collect(),
        _askers: askers.into_iter().map(Quit).collect(),
        targets,
        fence,
    }))
}

/// What a sentinel announced, and when the watch received it.
struct Announcement {
    event: Event,
    received: Instant,
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

/// A master's address as the sentinels give it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Address {
    host: String,
    port: u16,
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// What one sentinel said of the service (`SENTINEL MASTER <service>`), and when.
#[derive(Debug)]
struct MasterView {
    master: Address,
    /// Bumped by every switch: of two views, the higher names the later master.
    epoch: u64,
    down_after: Duration,
    failover_timeout: Duration,
    /// How long before the answer the sentinel last had a valid reply from the master.
    last_ok: Duration,
    /// The sentinel thinks the master down (`s_down`, `o_down`) or is failing it over.
    troubled: bool,
    /// The sentinel is failing the master over (`failover_in_progress`).
    in_failover: bool,
    asked: Instant,
}

impl MasterView {
    /// Reads the field list `SENTINEL MASTER` answers (an array of names and values in RESP2, a
    /// map in RESP3); `None` if a field the watch needs is missing.
    fn parse(answer: Value, asked: Instant) -> Option<Self> {
        let pairs = fields(answer)?;
        let field = |name: &str| {
            (pairs.iter())
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.as_str())
        };
        let millis = |name: &str| field(name)?.parse::<u64>().ok().map(Duration::from_millis);
        let flags = field("flags")?;
        let has = |flag: &str| flags.split(',').any(|set| set == flag);
        Some(Self {
            master: Address {
                host: field("ip")?.to_owned(),
                port: field("port")?.parse().ok()?,
            },
            epoch: field("config-epoch")?.parse().ok()?,
            down_after: millis("down-after-milliseconds")?,
            failover_timeout: millis("failover-timeout").unwrap_or(DEFAULT_FAILOVER_TIMEOUT),
            last_ok: millis("last-ok-ping-reply")?,
            troubled: has("s_down") || has("o_down") || has("failover_in_progress"),
            in_failover: has("failover_in_progress"),
            asked,
        })
    }

    /// The earliest moment this sentinel could promote a replica in a failover it starts by
    /// itself: `down-after-milliseconds` after its last valid reply from the master, or at once
    /// if it already thinks the master down or is failing it over.
    fn promotable_from(&self) -> Instant {
        if self.troubled {
            return self.asked;
        }
        (self.asked.checked_sub(self.last_ok))
            .unwrap_or(self.asked)
            .checked_add(self.down_after)
            .unwrap_or(self.asked)
    }
}

/// A fence that stands, and what the watch knew when it was raised.
struct Fenced {
    /// The master being failed over, if known.
    from: Option<Address>,
    raised: Instant,
    /// The highest config epoch known then: a view above it names the master after the switch.
    epoch: u64,
    /// The sentinels announced they gave up the failover.
    aborted: bool,
    next_report: Instant,
}

/// The watch's one task: it listens to the sentinels' events and keeps the fence and the
/// `blind` flag; being one task, no two reconnections of the store's clients overlap.
struct Watcher {
    /// How many listeners have made their subscriptions (each counts once).
    subscribed: Arc<std::sync::atomic::AtomicUsize>,
    targets: Arc<Mutex<Vec<Client>>>,
    fence: Arc<Fence>,
    subscribers: Vec<Client>,
    askers: Vec<Client>,
    service: String,
    /// The earliest moment the sentinels could promote a replica, from their latest answers;
    /// `None` while none has answered.
    promotable_from: Option<Instant>,
    failover_timeout: Option<Duration>,
    /// The highest config epoch the watch knows of (asked, or past a switch it followed).
    known_epoch: u64,
    /// Whether a subscription was heard at the last look.
    heard: bool,
    fenced: Option<Fenced>,
    /// The last `+switch-master` followed, and the last heard.
    followed: String,
    switch_seen: String,
    /// The last `+switch-master` whose following did not confirm the store there. Every sentinel
    /// announces a switch: one round of reconnections per switch is enough, and the looks, once
    /// a second, go on from there. Before, each announcement ran a round of its own, seconds
    /// each when the switch had been overtaken by another failover, while the announcements
    /// behind it waited: a 30-minute run of tests/history.rs (issue 36) acted on some 28 s late,
    /// raising the fence again over a store already on the right master, and holding its
    /// owners' renewals past their leases (keys ran twice).
    attempted: String,
    /// When the sentinels last answered that no failover is under way and named the master the
    /// store was then confirmed on. A switch announced before it is one those answers already
    /// reflect: acting on it late would only fence the store again, or send it back to a master
    /// since replaced.
    confirmed_at: Option<Instant>,
    /// The URL's sentinels, and their subscribers.
    url_addresses: Vec<(String, u16)>,
    url_subscribers: Vec<Client>,
    factory: SentinelClients,
    events: UnboundedSender<Announcement>,
    listeners: Vec<tokio::task::JoinHandle<()>>,
    /// The sentinels the URL's told of, listened to as well.
    discovered: Vec<Discovered>,
    heartbeat: Option<Heartbeat>,
    pace: Arc<Pace>,
    /// How many times the watch has looked (once a second).
    looks: u64,
    /// Whether a sentinel has told which others it knows (until then, it is asked every look).
    discovered_once: bool,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.listeners.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

/// A sentinel the URL's told of: its subscriber (quit, and its listener stopped, when dropped).
struct Discovered {
    address: (String, u16),
    listener: tokio::task::JoinHandle<()>,
    subscriber: Quit,
}

impl Drop for Discovered {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

/// Builds the watch's connections to sentinels: the URL's credentials for the sentinels, its
/// TLS, the store's connection settings and reconnect policy.
struct SentinelClients {
    template: Config,
    connection: fred::types::config::ConnectionConfig,
    policy: ReconnectPolicy,
}

impl SentinelClients {
    fn build(&self, sentinel: Server) -> Result<Client, fred::error::Error> {
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

impl Watcher {
    async fn run(mut self, mut announced: UnboundedReceiver<Announcement>) {
        for subscriber in self.subscribers.clone() {
            self.listeners.push(tokio::spawn(listen(
                subscriber,
                self.events.clone(),
                self.subscribed.clone(),
            )));
        }
        self.heartbeat = Some(Heartbeat::start(
            Role::Sentinels,
            Watched::Shared(self.subscribers.clone()),
            self.pace.clone(),
        ));
        // The sentinels the URL's know of are listened to from the start: an asker connects in
        // milliseconds, or is down, and then the next looks try again.
        let connected = async {
            while !self.askers.iter().any(|asker| asker.is_connected()) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let _ = tokio::time::timeout(ASK_TIMEOUT, connected).await;
        self.discover().await;
        self.start_listening(&mut announced).await;
        let mut ticks = tokio::time::interval(liveness::DEFAULT_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Events are followed from the first moment; the looks, which judge whether a
        // sentinel is heard, start after the subscribers' first beats (the first two ticks).
        // Before issue 36 the events waited for those two ticks too, and a failover announced
        // in a new store's first second fenced it a second late: it claimed on the old master
        // meanwhile, and keys ran twice (found by tests/history.rs).
        let mut beats = 0u8;
        loop {
            tokio::select! {
                announcement = announced.recv() => match announcement {
                    Some(announcement) if announcement.event.names(&self.service) => {
                        self.on_announcement(announcement).await
                    }
                    Some(_) => {}
                    None => return,
                },
                _ = ticks.tick() => {
                    if beats < 2 {
                        beats += 1;
                    } else {
                        self.look().await;
                    }
                }
            }
        }
    }

    /// Acts on an announcement, unless it is a switch and the sentinels answered since that no
    /// failover is under way (see [`confirmed_at`](Self::confirmed_at)): a switch that waited
    /// behind other announcements is news no longer. A promotion is always acted on: a fence
    /// raised for one already over costs a second at most (the next look lowers it), while one
    /// missed, if the sentinels that would show it did not answer, would let claims go to a
    /// master being replaced.
    async fn on_announcement(&mut self, announcement: Announcement) {
        let superseded = matches!(announcement.event, Event::Switched(_))
            && (self.confirmed_at).is_some_and(|confirmed| announcement.received < confirmed);
        if superseded {
            tracing::debug!(
                waited = ?announcement.received.elapsed(),
                "an announcement the sentinels' answers since superseded; not acted on"
            );
            return;
        }
        self.on_event(announcement.event).await;
    }

    async fn on_event(&mut self, event: Event) {
        match event {
            Event::Promoting(text) => {
                tracing::info!(replica = %text, "the sentinels are promoting a replica; refusing new claims until the new master is confirmed");
                self.raise(announced_old_master(&text));
            }
            Event::Aborted(text) => {
                if let Some(fenced) = &mut self.fenced {
                    tracing::info!(%text, "the sentinels aborted the failover; taking writes again once the store is confirmed on the master they name");
                    fenced.aborted = true;
                    let views = self.ask().await;
                    self.try_lower(&views).await;
                }
            }
            // "<service> <old ip> <old port> <new ip> <new port>", from every sentinel.
            Event::Switched(switch) if switch != self.followed && switch != self.attempted => {
                tracing::info!(%switch, "the sentinels switched the master; reconnecting to the new one");
                // The sentinels that did not lead the failover name the old master at the old
                // epoch until they hear of the switch: never follow them back. Once per switch:
                // every sentinel announces it.
                if switch != self.switch_seen {
                    // At least one above the epoch the failover began at (the leader's answers
                    // may have told it already).
                    let began = self
                        .fenced
                        .as_ref()
                        .map_or(self.known_epoch, |fenced| fenced.epoch);
                    self.known_epoch = self.known_epoch.max(began + 1);
                    self.switch_seen.clone_from(&switch);
                }
                let Some(master) = announced_master(&switch) else {
                    // No address to check against: reconnect once, as the sentinels direct.
                    let clients = self.clients();
                    futures_util::future::join_all(clients.iter().map(reconnect)).await;
                    self.followed = switch;
                    self.lower("the sentinels switched the master (an announcement the watch cannot read)");
                    return;
                };
                if self.fenced.is_none() {
                    // A sentinel's announcement can come late (a slow link to it): one whose new
                    // master is a replica now was overtaken by a later failover, which the store
                    // followed already. Acting on it would fence the store and reconnect it in
                    // vain, holding its owners' writes meanwhile.
                    if self.now_a_replica(&master).await {
                        tracing::info!(%switch, "a late announcement of a switch since overtaken (its new master is a replica now); not acted on");
                        return;
                    }
                    // The promotion went unheard: fenced until the store is confirmed there.
                    self.raise(announced_old(&switch));
                }
                if self.follow(&master).await && self.master_confirmed().await {
                    self.followed = switch;
                    self.lower(&format!(
                        "the store is on the new master {master}, which answers as a master"
                    ));
                } else {
                    tracing::warn!(
                        %switch,
                        "after {FOLLOW_ATTEMPTS} reconnections the store is not confirmed on the announced master; \
                         claims stay refused and the sentinels are asked again every second"
                    );
                    // Overtaken by another failover: the switch followed before is no longer
                    // where the store is, and the next one may repeat its text (failovers cycle
                    // among the same nodes: A to B, then B back to A). Before, a double failover
                    // back to the master followed before was taken for that old switch and not
                    // followed: the fence stood until the next failover, 15 s in a run of
                    // tests/history.rs (issue 36).
                    self.followed.clear();
                    self.attempted = switch;
                }
            }
            Event::Switched(_) => {}
        }
    }

    /// Once a second: asks the sentinels, judges whether the store is blind, follows a master
    /// named after sight came back, and tries to lower a fence that stands.
    async fn look(&mut self) {
        self.looks += 1;
        if self.looks % DISCOVER_EVERY == 0 || !self.discovered_once {
            self.discover().await;
        }
        let views = self.ask().await;
        if !views.is_empty() {
            self.promotable_from = views.iter().map(MasterView::promotable_from).min();
            self.failover_timeout = views.iter().map(|view| view.failover_timeout).max();
            let epoch = views.iter().map(|view| view.epoch).max().unwrap_or(0);
            self.known_epoch = self.known_epoch.max(epoch);
        }
        // With the heartbeat off, a silent subscription goes unseen: only one that fred knows to
        // be down counts.
        let heartbeat = self.heartbeat.as_ref();
        let heard = (self.subscribers.iter().enumerate()).any(|(index, subscriber)| {
            subscriber.is_connected() && !heartbeat.is_some_and(|heartbeat| heartbeat.is_silent(index))
        });
        let now = Instant::now();
        if self.heard && !heard {
            match self.promotable_from.filter(|from| *from > now) {
                Some(from) => tracing::info!(
                    "no sentinel can be heard; no failover can promote a replica for {:?} \
                     (down-after-milliseconds since the sentinels last heard the master), so claims go on until then",
                    from - now
                ),
                None => tracing::info!("no sentinel can be heard"),
            }
        } else if !self.heard && heard {
            self.regain(&views).await;
        }
        self.heard = heard;
        let blind = !heard && self.promotable_from.is_none_or(|from| now >= from);
        if blind && !self.fence.is_blind() {
            tracing::warn!(
                "no sentinel can be heard, and a failover could have promoted a replica since \
                 (down-after-milliseconds has passed, the sentinels think the master down, or \
                 their settings could not be read): claims are refused until one is heard"
            );
            telemetry::connection_event(Role::Sentinels, ConnectionEvent::FeedLost);
            self.fence.blind.store(true, Ordering::Release);
        } else if !blind && self.fence.is_blind() {
            tracing::info!("a sentinel is heard again; the store is on the master it names and takes claims");
            telemetry::connection_event(Role::Sentinels, ConnectionEvent::FeedBack);
            self.fence.blind.store(false, Ordering::Release);
        }
        if self.fenced.is_some() {
            self.try_lower(&views).await;
        }
        if let Some(fenced) = &mut self.fenced {
            if now >= fenced.next_report {
                fenced.next_report = now + LONG_FENCE_REPORT;
                tracing::warn!(
                    "a failover began {:?} ago and the new master is not confirmed yet (the sentinels \
                     {}): claims are refused (503, counted `fenced`) and owners' writes held until it is",
                    fenced.raised.elapsed(),
                    if views.is_empty() {
                        "do not answer"
                    } else {
                        "name no new master the store is confirmed on"
                    },
                );
            }
        }
    }

    /// Lets claims through once the watch listens: every subscription made so far is in place (or
    /// [`START_BOUND`] has passed), the sentinels were asked whether a failover is under way,
    /// which raises the fence if one is, and the events announced meanwhile are followed. Before, a store took claims from its first moment, and
    /// one started in the second before a failover missed its announcement and claimed on the
    /// old master (keys ran twice with the durability option: a replica not promoted still
    /// acknowledged there).
    async fn start_listening(&mut self, announced: &mut UnboundedReceiver<Announcement>) {
        let deadline = Instant::now() + START_BOUND;
        while self.subscribed.load(Ordering::Acquire) < self.subscribers.len() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let views = self.ask().await;
        if views.iter().any(|view| view.in_failover) {
            tracing::info!("the sentinels are failing the master over as the store starts; refusing claims until the new master is confirmed");
            self.raise(None);
        }
        // What was announced meanwhile is followed before the first claim goes through.
        while let Ok(announcement) = announced.try_recv() {
            if announcement.event.names(&self.service) {
                self.on_announcement(announcement).await;
            }
        }
        self.fence.start_listening();
    }

    /// Subscribes to the sentinels that the ones it asks know of (`SENTINEL SENTINELS`), so that
    /// the failover's leader is heard even when the URL names one address for all of them (a
    /// Kubernetes Service in front of the sentinels): only the leader announces a promotion.
    /// Stops listening to a sentinel none of them knows of any more (a pod replaced under a new
    /// address, once the sentinels are reset).
    async fn discover(&mut self) {
        let mut found: Vec<(String, u16)> = Vec::new();
        // How many sentinels watch the service, as the best-informed one counts them; none if
        // no sentinel answered.
        let mut sentinels_known = None;
        for asker in self.askers.iter().filter(|asker| asker.is_connected()) {
            let command = CustomCommand::new_static("SENTINEL", ClusterHash::Random, false);
            let question = asker.custom::<Value, _>(command, vec!["SENTINELS", self.service.as_str()]);
            let Ok(Ok(Value::Array(sentinels))) = tokio::time::timeout(ASK_TIMEOUT, question).await else {
                continue;
            };
            self.discovered_once = true;
            sentinels_known = Some(sentinels_known.unwrap_or(0).max(sentinels.len() + 1));
            found.extend(sentinels.into_iter().filter_map(|sentinel| {
                let fields = fields(sentinel)?;
                let field = |name: &str| {
                    (fields.iter())
                        .find(|(key, _)| key == name)
                        .map(|(_, value)| value.clone())
                };
                Some((field("ip")?, field("port")?.parse::<u16>().ok()?))
            }));
        }
        let Some(sentinels_known) = sentinels_known else {
            return;
        };
        if sentinels_known <= self.askers.len() {
            // The URL names as many addresses as there are sentinels: it reaches each already,
            // perhaps through addresses of its own (a proxy, a NAT) where the ones the
            // sentinels announce cannot be reached, or must not be.
            found.clear();
        }
        let before = self.discovered.len();
        self.discovered
            .retain(|sentinel| found.contains(&sentinel.address));
        let mut changed = self.discovered.len() != before;
        for address in found {
            let listened = (self.url_addresses.iter())
                .chain(self.discovered.iter().map(|sentinel| &sentinel.address))
                .any(|known| *known == address);
            if listened {
                continue;
            }
            let (host, port) = address.clone();
            let subscriber = match self.factory.build(Server::new(host.clone(), port)) {
                Ok(subscriber) => subscriber,
                Err(error) => {
                    tracing::warn!(%error, %host, port, "cannot listen to a sentinel the others told of");
                    continue;
                }
            };
            tracing::debug!(%host, port, "listening to a sentinel the others told of");
            self.discovered.push(Discovered {
                address,
                listener: tokio::spawn(listen(
                    subscriber.clone(),
                    self.events.clone(),
                    self.subscribed.clone(),
                )),
                subscriber: Quit(subscriber),
            });
            changed = true;
        }
        if changed {
            self.subscribers = (self.url_subscribers.iter().cloned())
                .chain(
                    self.discovered
                        .iter()
                        .map(|sentinel| sentinel.subscriber.0.clone()),
                )
                .collect();
            // The heartbeat watches a fixed list: one over the new list replaces it.
            self.heartbeat = Some(Heartbeat::start(
                Role::Sentinels,
                Watched::Shared(self.subscribers.clone()),
                self.pace.clone(),
            ));
        }
    }

    /// A subscription is heard again after none was: the master may have been switched while
    /// nobody heard. Goes where the sentinels name the master now, reconnecting only the clients
    /// that are not there (every client if no sentinel answers).
    async fn regain(&mut self, views: &[MasterView]) {
        let latest = (views.iter())
            .filter(|view| view.epoch >= self.known_epoch)
            .max_by_key(|view| view.epoch);
        let Some(view) = latest else {
            tracing::warn!(
                "a sentinel is heard again but none says which master it names: reconnecting every client"
            );
            let clients = self.clients();
            futures_util::future::join_all(clients.iter().map(reconnect)).await;
            return;
        };
        if view.in_failover && self.fenced.is_none() {
            tracing::info!("a sentinel is heard again and is failing the master over; refusing new claims until the new master is confirmed");
            self.raise(Some(view.master.clone()));
        }
        if !self.follow(&view.master).await {
            tracing::warn!(master = %view.master, "a sentinel is heard again, and the store could not reach the master it names; the reconnect policy retries");
        }
    }

    /// Lowers a standing fence if the failover is over and the store confirmed on the master
    /// it left: switched (a view names a later master than the one fenced) or given up
    /// (announced, or nothing changed for longer than a failover can take).
    async fn try_lower(&mut self, views: &[MasterView]) {
        let Some(fenced) = &self.fenced else { return };
        let Some(latest) = views.iter().max_by_key(|view| view.epoch) else {
            return;
        };
        // The leader bumps the master's config epoch when the replica takes the promotion, but
        // names the old master until the switch, its replicas' reconfiguration done: a view
        // still failing over names no new master yet.
        let quiet = !views.iter().any(|view| view.in_failover);
        let switched = !latest.in_failover
            && match &fenced.from {
                Some(from) => *from != latest.master,
                None => latest.epoch > fenced.epoch,
            };
        let failover_timeout = self.failover_timeout.unwrap_or(DEFAULT_FAILOVER_TIMEOUT);
        let given_up = !switched
            && !views.iter().any(|view| view.in_failover)
            && (fenced.aborted || fenced.raised.elapsed() > failover_timeout * 2 + ENDED_MARGIN);
        if !switched && !given_up {
            return;
        }
        let master = latest.master.clone();
        let asked = views.iter().map(|view| view.asked).min();
        if self.follow(&master).await && self.master_confirmed().await {
            if quiet {
                self.confirmed_at = asked;
            }
            if switched {
                self.lower(&format!(
                    "the sentinels name the new master {master}, and the store is on it"
                ));
            } else {
                self.lower(&format!(
                    "the failover ended with no switch; the store is on the master {master}"
                ));
            }
        }
    }

    fn raise(&mut self, from: Option<Address>) {
        let now = Instant::now();
        self.fenced.get_or_insert(Fenced {
            from,
            raised: now,
            epoch: self.known_epoch,
            aborted: false,
            next_report: now + LONG_FENCE_REPORT,
        });
        self.fence.raise();
    }

    fn lower(&mut self, why: &str) {
        // A switch whose following failed is over with the failover: the same pair of
        // addresses announced again later is a new switch.
        self.attempted.clear();
        if let Some(fenced) = self.fenced.take() {
            tracing::info!(
                "{why}: taking writes again, {:?} after the fence was raised",
                fenced.raised.elapsed()
            );
        }
        self.fence.lower();
    }

    fn clients(&self) -> Vec<Client> {
        self.targets
            .lock()
            .map(|clients| clients.clone())
            .unwrap_or_default()
    }

    /// Asks every sentinel connected now what it names (`SENTINEL MASTER`), at once; the
    /// answers that came within [`ASK_TIMEOUT`].
    async fn ask(&self) -> Vec<MasterView> {
        let asking = (self.askers.iter())
            .filter(|asker| asker.is_connected())
            .map(|asker| async move {
                let command = CustomCommand::new_static("SENTINEL", ClusterHash::Random, false);
                let asked = Instant::now();
                let question = asker.custom::<Value, _>(command, vec!["MASTER", self.service.as_str()]);
                match tokio::time::timeout(ASK_TIMEOUT, question).await {
                    Ok(Ok(answer)) => MasterView::parse(answer, asked),
                    Ok(Err(error)) => {
                        tracing::debug!(%error, "a sentinel did not answer SENTINEL MASTER");
                        None
                    }
                    Err(_) => {
                        // A silent connection (its answers would come too late to be useful):
                        // a new one, which carries nothing of a caller's.
                        let _ = tokio::time::timeout(ASK_TIMEOUT, asker.force_reconnection()).await;
                        None
                    }
                }
            });
        futures_util::future::join_all(asking)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Reconnects the store's clients that are not on `master` until all are, at most
    /// [`FOLLOW_ATTEMPTS`] times; whether they are. A client already there is left alone: a
    /// reconnection re-sends its commands in flight.
    async fn follow(&self, master: &Address) -> bool {
        let clients = self.clients();
        for attempt in 0..FOLLOW_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(FOLLOW_PAUSE).await;
            }
            let strays: Vec<&Client> = clients.iter().filter(|client| !is_on(client, master)).collect();
            if strays.is_empty() {
                return true;
            }
            futures_util::future::join_all(strays.into_iter().map(reconnect)).await;
        }
        clients.iter().all(|client| is_on(client, master))
    }

    /// Whether the server the store's own client is on answers `ROLE` as a master (a replica
    /// the sentinels named may not have taken the promotion yet).
    async fn master_confirmed(&self) -> bool {
        let Some(client) = self.clients().into_iter().next() else {
            return false;
        };
        let command = CustomCommand::new_static("ROLE", ClusterHash::Random, false);
        match tokio::time::timeout(ASK_TIMEOUT, client.custom::<Value, Value>(command, vec![])).await {
            Ok(Ok(Value::Array(role))) => role.first().and_then(Value::as_str).as_deref() == Some("master"),
            _ => false,
        }
    }
}

impl Watcher {
    /// Whether the server at `address` answers `ROLE` as a replica, asked on a connection of
    /// its own (the store's clients are on the master: moving one would move its commands), with
    /// the store's credentials and TLS. `false` when it answers anything else or nothing within
    /// [`ASK_TIMEOUT`]: only a replica is certain proof that a switch to it was overtaken.
    async fn now_a_replica(&self, address: &Address) -> bool {
        let Some(store) = self.clients().into_iter().next() else {
            return false;
        };
        let config = Config {
            server: ServerConfig::Centralized {
                server: Server::new(address.host.clone(), address.port),
            },
            ..store.client_config()
        };
        let Ok(client) = Builder::from_config(config)
            .set_connection_config(self.factory.connection.clone())
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
}

/// Listens on one sentinel and hands its events for any service to the watch.
async fn listen(
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

/// The names and values of a sentinel's description of an instance: an array of names and
/// values in turn in RESP2, a map in RESP3.
fn fields(answer: Value) -> Option<Vec<(String, String)>> {
    match answer {
        Value::Map(map) => Some(
            (map.inner().into_iter())
                .filter_map(|(key, value)| Some((key.as_str()?.to_owned(), value.as_string()?)))
                .collect(),
        ),
        Value::Array(items) => Some(
            (items.chunks_exact(2))
                .filter_map(|pair| Some((pair[0].as_string()?, pair[1].as_string()?)))
                .collect(),
        ),
        _ => None,
    }
}

/// Whether `client` is connected to `master` (as the address it connected to says).
fn is_on(client: &Client, master: &Address) -> bool {
    client.is_connected()
        && (client.active_connections().iter())
            .any(|server| *server.host == *master.host && server.port == master.port)
}

/// The new master a `+switch-master` names: `<service> <old ip> <old port> <new ip> <new port>`.
fn announced_master(switch: &str) -> Option<Address> {
    let fields: Vec<&str> = switch.split(' ').collect();
    let [_, _, _, host, port] = fields[..] else {
        return None;
    };
    Some(Address {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

/// The old master a `+switch-master` names.
fn announced_old(switch: &str) -> Option<Address> {
    let fields: Vec<&str> = switch.split(' ').collect();
    let [_, host, port, _, _] = fields[..] else {
        return None;
    };
    Some(Address {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

/// The master a promotion event names: `slave <name> <ip> <port> @ <service> <ip> <port>`.
fn announced_old_master(promoting: &str) -> Option<Address> {
    let (_, master) = promoting.split_once(" @ ")?;
    let fields: Vec<&str> = master.split(' ').collect();
    let [_, host, port] = fields[..] else {
        return None;
    };
    Some(Address {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

/// Reconnects `client`: fred asks a sentinel for the master and connects there.
async fn reconnect(client: &Client) {
    if let Err(error) = client.force_reconnection().await {
        tracing::warn!(%error, "reconnecting to the master the sentinels name failed; the reconnect policy retries");
    }
}

/// A fence a test raises and lowers itself, in a watch that follows no sentinel: the store's
/// completions, renewals and claims meet it as they meet the one a failover raises.
#[cfg(test)]
pub(super) fn held_by_test() -> (SwitchWatch, Arc<Fence>) {
    let fence = Arc::new(Fence::default());
    fence.start_listening();
    let watch = SwitchWatch {
        task: tokio::spawn(async {}),
        _subscribers: Vec::new(),
        _askers: Vec::new(),
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

    use fred::types::Value;
    use tokio::time::Instant;

    use super::{announced_master, announced_old, announced_old_master, Address, Event, Fence, MasterView};

    fn address(host: &str, port: u16) -> Option<Address> {
        Some(Address {
            host: host.to_owned(),
            port,
        })
    }

    /// `SENTINEL MASTER`'s answer in RESP2: names and values in turn.
    fn answer(flags: &str, last_ok: u64) -> Value {
        let fields = [
            ("name", "main".to_owned()),
            ("ip", "10.0.0.1".to_owned()),
            ("port", "7000".to_owned()),
            ("flags", flags.to_owned()),
            ("last-ok-ping-reply", last_ok.to_string()),
            ("down-after-milliseconds", "10000".to_owned()),
            ("config-epoch", "3".to_owned()),
            ("failover-timeout", "60000".to_owned()),
        ];
        Value::Array(
            (fields.into_iter())
                .flat_map(|(name, value)| [Value::from(name), Value::from(value)])
                .collect(),
        )
    }

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

    /// A healthy master cannot be promoted away before `down-after-milliseconds` after the
    /// sentinel last heard it; one it thinks down, or is failing over, at once.
    #[test]
    fn the_earliest_promotion_is_read_from_the_sentinels_answer() {
        let asked = Instant::now();
        let healthy = MasterView::parse(answer("master", 400), asked).expect("a full answer");
        assert_eq!(healthy.master, address("10.0.0.1", 7000).expect("an address"));
        assert_eq!(healthy.epoch, 3);
        assert_eq!(healthy.failover_timeout, Duration::from_secs(60));
        assert_eq!(healthy.promotable_from(), asked + Duration::from_millis(9600));
        for flags in [
            "master,s_down",
            "master,s_down,o_down",
            "master,failover_in_progress",
        ] {
            let troubled = MasterView::parse(answer(flags, 400), asked).expect("a full answer");
            assert_eq!(troubled.promotable_from(), asked, "{flags}");
        }
        assert!(MasterView::parse(
            Value::Array(vec![Value::from("name"), Value::from("main")]),
            asked
        )
        .is_none());
        assert!(MasterView::parse(Value::from("ERR unknown command"), asked).is_none());
    }
}
