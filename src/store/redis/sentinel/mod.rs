//! Following a Sentinel failover as the sentinels run it, for a `RedisStore` connected with a
//! `redis-sentinel://` URL.
//!
//! During a failover the old master may stay reachable and keep acknowledging writes: after the
//! sentinels promote a replica (`REPLICAOF NO ONE`) and until they demote the old master, seconds
//! later, everything written there is thrown away. Claims written there let a retry run a key
//! again. So the store listens to every sentinel: those of its URL, and, when the URL names
//! fewer addresses than there are sentinels, those they know of (`SENTINEL SENTINELS`, asked
//! of each every [`DISCOVER_EVERY`](watcher::DISCOVER_EVERY) seconds, at their announced addresses), since only the failover's
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
//!   ([`FOLLOW_ATTEMPTS`](watcher::FOLLOW_ATTEMPTS)), and the other sentinels' announcements of a switch not followed yet
//!   are acted on too;
//! - the fence comes down only once the new master is *confirmed*: every client of the store is
//!   connected to it and it answers `ROLE` as a master. Until then it stays up, however long:
//!   no timer lowers it (a promotion can wait for a slow replica, an election can be retried).
//!   While it stands, the sentinels are asked each second (`SENTINEL MASTER`) what they name, so
//!   a switch whose announcement went unheard is followed too; a failover the sentinels gave up
//!   (`-failover-abort-*`, or, unheard, nothing changed after twice their `failover-timeout`,
//!   the longest a failover can take, with its two timed phases) lowers it once the store is
//!   confirmed on the master they name, and so does a failover every sentinel answered, since
//!   the fence rose, that it is not running (every sentinel: the URL's, and where it names
//!   fewer, every one the sentinels' lists name, each asked at its own address; only the
//!   leader, which shows `failover_in_progress` until the end, announces a promotion; a late
//!   one, of a failover since undone, fenced the store for the timeout before, and behind one
//!   sentinel address until issue 36 was closed). A fence that stands is logged every
//!   [`LONG_FENCE_REPORT`](watcher::LONG_FENCE_REPORT), and every claim it refuses is counted `fenced`;
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
//!
//! The parts: `fence` (what claims and owners' writes meet), `events` (the announcements and
//! the subscriptions that hear them), `views` (what a sentinel answers of its master), `watcher`
//! (the one task that acts on both), `connections` (the watch's own connections).

mod connections;
mod events;
mod fence;
mod views;
mod watcher;

use std::sync::{Arc, Mutex};

use fred::clients::Client;
use fred::interfaces::ClientLike;
use fred::types::config::{Config, ReconnectPolicy, ServerConfig};

use super::connection::Quit;
use super::liveness::{self, Pace};
use connections::SentinelClients;
use events::Announcement;
pub(super) use fence::Fence;
use watcher::Watcher;

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
        census: None,
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
