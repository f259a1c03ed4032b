//! The watch's one task: it acts on the sentinels' announcements and asks them once a second,
//! raising and lowering the fence (see the module above).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fred::clients::Client;
use fred::error::ErrorKind;
use fred::interfaces::ClientLike;
use fred::types::config::Server;
use fred::types::{ClusterHash, CustomCommand, Value};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio::time::Instant;

use super::super::connection::Quit;
use super::super::liveness::{self, Heartbeat, Pace, Watched};
use super::connections::{is_on, now_a_replica, reconnect, Discovered, SentinelClients, ASK_TIMEOUT};
use super::events::{
    announced_master, announced_old, announced_old_master, listen, Address, Announcement, Event,
};
use super::fence::Fence;
use super::views::{fields, MasterView, DEFAULT_FAILOVER_TIMEOUT};
use crate::telemetry::{self, Connection as Role, ConnectionEvent};

/// How many times one attempt to follow a master reconnects the store's clients that are not on
/// it, a pause apart.
pub(super) const FOLLOW_ATTEMPTS: u32 = 20;
pub(super) const FOLLOW_PAUSE: Duration = Duration::from_millis(50);
/// A failover ended with no switch only after twice the `failover-timeout` (the sentinels time
/// out the promotion and then the replicas' reconfiguration, each after one) and this much more:
/// the sentinels that did not lead it learn of its end from the leader's hello messages, sent
/// every 2 s.
pub(super) const ENDED_MARGIN: Duration = Duration::from_secs(5);
/// How often (in looks, one a second) the watch asks the sentinels which others they know.
pub(super) const DISCOVER_EVERY: u64 = 10;
/// How often a fence that stands is logged again.
pub(super) const LONG_FENCE_REPORT: Duration = Duration::from_secs(30);
/// How long a new store waits for its subscriptions to the sentinels before it takes claims
/// without those not made yet (a sentinel down at the start is subscribed to when it is back;
/// the blind rule covers a store that hears none).
pub(super) const START_BOUND: Duration = Duration::from_secs(5);

/// A fence that stands, and what the watch knew when it was raised.
pub(super) struct Fenced {
    /// The master being failed over, if known.
    pub(super) from: Option<Address>,
    pub(super) raised: Instant,
    /// The highest config epoch known then: a view above it names the master after the switch.
    pub(super) epoch: u64,
    /// The sentinels announced they gave up the failover.
    pub(super) aborted: bool,
    pub(super) next_report: Instant,
}

/// What the sentinels told of one another (`SENTINEL SENTINELS`), asked of every sentinel the
/// watch asks (the URL's and those discovered).
#[derive(Clone, Debug)]
pub(super) struct Census {
    /// How many sentinels watch the service, as the best-informed one counts them (itself
    /// included).
    pub(super) count: usize,
    /// The addresses the sentinels announce, as their lists name them (a sentinel lists the
    /// others, never itself, so these name every sentinel once two of them answered).
    pub(super) announced: Vec<(String, u16)>,
    /// When the question was asked.
    pub(super) asked: Instant,
}

/// The watch's one task: it listens to the sentinels' events and keeps the fence and the
/// `blind` flag; being one task, no two reconnections of the store's clients overlap.
pub(super) struct Watcher {
    /// How many listeners have made their subscriptions (each counts once).
    pub(super) subscribed: Arc<std::sync::atomic::AtomicUsize>,
    pub(super) targets: Arc<Mutex<Vec<Client>>>,
    pub(super) fence: Arc<Fence>,
    pub(super) subscribers: Vec<Client>,
    pub(super) askers: Vec<Client>,
    pub(super) service: String,
    /// The earliest moment the sentinels could promote a replica, from their latest answers;
    /// `None` while none has answered.
    pub(super) promotable_from: Option<Instant>,
    pub(super) failover_timeout: Option<Duration>,
    /// The highest config epoch the watch knows of (asked, or past a switch it followed).
    pub(super) known_epoch: u64,
    /// Whether a subscription was heard at the last look.
    pub(super) heard: bool,
    pub(super) fenced: Option<Fenced>,
    /// The last `+switch-master` followed, and the last heard.
    pub(super) followed: String,
    pub(super) switch_seen: String,
    /// The last `+switch-master` whose following did not confirm the store there. Every sentinel
    /// announces a switch: one round of reconnections per switch is enough, and the looks, once
    /// a second, go on from there. Before, each announcement ran a round of its own, seconds
    /// each when the switch had been overtaken by another failover, while the announcements
    /// behind it waited: a 30-minute run of tests/history.rs (issue 36) acted on some 28 s late,
    /// raising the fence again over a store already on the right master, and holding its
    /// owners' renewals past their leases (keys ran twice).
    pub(super) attempted: String,
    /// When the sentinels last answered that no failover is under way and named the master the
    /// store was then confirmed on. A switch announced before it is one those answers already
    /// reflect: acting on it late would only fence the store again, or send it back to a master
    /// since replaced.
    pub(super) confirmed_at: Option<Instant>,
    /// The URL's sentinels, and their subscribers.
    pub(super) url_addresses: Vec<(String, u16)>,
    pub(super) url_subscribers: Vec<Client>,
    pub(super) factory: SentinelClients,
    pub(super) events: UnboundedSender<Announcement>,
    pub(super) listeners: Vec<tokio::task::JoinHandle<()>>,
    /// The sentinels the URL's told of, listened to as well.
    pub(super) discovered: Vec<Discovered>,
    pub(super) heartbeat: Option<Heartbeat>,
    pub(super) pace: Arc<Pace>,
    /// What the sentinels told of one another at the last `SENTINEL SENTINELS` answered; `None`
    /// if none answered.
    pub(super) census: Option<Census>,
    /// How many times the watch has looked (once a second).
    pub(super) looks: u64,
    /// Whether a sentinel has told which others it knows (until then, it is asked every look).
    pub(super) discovered_once: bool,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.listeners.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

impl Watcher {
    pub(super) async fn run(mut self, mut announced: UnboundedReceiver<Announcement>) {
        for subscriber in self.subscribers.clone() {
            self.listeners.push(self.listen(subscriber));
        }
        self.beat_on_subscribers();
        // The sentinels the URL's know of are listened to from the start: an asker connects in
        // milliseconds, or is down, and then the next looks try again.
        let connected = async {
            while !self.askers.iter().any(|asker| asker.is_connected()) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let _ = tokio::time::timeout(ASK_TIMEOUT, connected).await;
        let discovered = self.discover().await;
        self.start_listening(&mut announced, discovered).await;
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
    /// raised for one already over costs a second or two (the next looks lower it once every
    /// sentinel, named by the URL or discovered, answers that it fails nothing over, see
    /// [`try_lower`](Self::try_lower)), and up to 2 × `failover-timeout` + [`ENDED_MARGIN`]
    /// where one does not answer. A promotion missed, if the sentinels that would show it did
    /// not answer, would let claims go to a master being replaced.
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
                    let store = self.clients().into_iter().next();
                    let overtaken = match store {
                        Some(store) => now_a_replica(&store, &self.factory.connection, &master).await,
                        None => false,
                    };
                    if overtaken {
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
        // While a fence stands, every look counts the sentinels afresh: `try_lower` trusts
        // their quiet answers only from every one of them, a sentinel added since included.
        if self.looks % DISCOVER_EVERY == 0 || !self.discovered_once || self.fenced.is_some() {
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
    async fn start_listening(
        &mut self,
        announced: &mut UnboundedReceiver<Announcement>,
        mut discovered: bool,
    ) {
        let deadline = Instant::now() + START_BOUND;
        // Only a failover's leader announces the promotion: until the sentinels the URL's know
        // of are listened to, one led by another would go unheard. A first question lost (its
        // connection cut, or unanswered within `ASK_TIMEOUT` on a loaded machine) is asked
        // again before the first claim, not at the looks seconds later, during which a store
        // took claims hearing the URL's sentinels only (a_store_takes_no_claim_before_it_listens_
        // to_the_sentinels_its_sentinel_knows, tests/redis_sentinel.rs).
        while !discovered && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            discovered = self.discover().await;
        }
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
    /// The sentinels discovered are asked too: their lists name the one behind the URL's
    /// address at its own, so that every sentinel is listened to and asked at the address it
    /// announces, whichever one the URL's address reaches. Stops listening to a sentinel none
    /// of them knows of any more (a pod replaced under a new address, once the sentinels are
    /// reset). Returns whether a sentinel answered, with its list or a refusal.
    async fn discover(&mut self) -> bool {
        let mut answered = false;
        let asked = Instant::now();
        let mut found: Vec<(String, u16)> = Vec::new();
        // How many sentinels watch the service, as the best-informed one counts them; none if
        // no sentinel answered.
        let mut sentinels_known = None;
        let askers: Vec<Client> = (self.every_asker())
            .filter(|asker| asker.is_connected())
            .cloned()
            .collect();
        for asker in &askers {
            let command = CustomCommand::new_static("SENTINEL", ClusterHash::Random, false);
            let question = asker.custom::<Value, _>(command, vec!["SENTINELS", self.service.as_str()]);
            let sentinels = match tokio::time::timeout(ASK_TIMEOUT, question).await {
                Ok(Ok(Value::Array(sentinels))) => sentinels,
                Ok(Err(error))
                    if !matches!(
                        error.kind(),
                        ErrorKind::IO | ErrorKind::Timeout | ErrorKind::Canceled
                    ) =>
                {
                    // Refused (an ACL, a renamed command): asking again at once would not help.
                    answered = true;
                    continue;
                }
                _ => continue,
            };
            answered = true;
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
        found.sort_unstable();
        found.dedup();
        self.census = sentinels_known.map(|count| Census {
            count,
            announced: found.clone(),
            asked,
        });
        let Some(sentinels_known) = sentinels_known else {
            return answered;
        };
        let mut named: Vec<&(String, u16)> = self.url_addresses.iter().collect();
        named.sort_unstable();
        named.dedup();
        if sentinels_known <= named.len() {
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
            let build = || self.factory.build(Server::new(host.clone(), port));
            let (subscriber, asker) = match (build(), build()) {
                (Ok(subscriber), Ok(asker)) => (subscriber, asker),
                (Err(error), _) | (_, Err(error)) => {
                    tracing::warn!(%error, %host, port, "cannot listen to or ask a sentinel the others told of");
                    continue;
                }
            };
            // Connected in the background, as the URL's: until it is, this sentinel is not
            // asked, and a fence that waits for every sentinel's answer stands.
            let _connection_task = asker.connect();
            tracing::debug!(%host, port, "listening to a sentinel the others told of");
            self.discovered.push(Discovered {
                address,
                listener: self.listen(subscriber.clone()),
                subscriber: Quit(subscriber),
                asker: Quit(asker),
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
            self.beat_on_subscribers();
        }
        answered
    }

    /// A task that hands the sentinel events `subscriber` hears to this watch.
    fn listen(&self, subscriber: Client) -> tokio::task::JoinHandle<()> {
        tokio::spawn(listen(subscriber, self.events.clone(), self.subscribed.clone()))
    }

    /// Starts the heartbeat over the subscribers. It watches a fixed list: one over a new list
    /// replaces the one before.
    fn beat_on_subscribers(&mut self) {
        let subscribers = Watched::Shared(self.subscribers.clone());
        self.heartbeat = Some(Heartbeat::start(Role::Sentinels, subscribers, self.pace.clone()));
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
    /// (announced, every sentinel quiet since the fence rose, or nothing changed for longer
    /// than a failover can take).
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
        // Only a failover's leader announces the promotion, and its `SENTINEL MASTER` shows
        // `failover_in_progress` from before it does until the failover switches or is
        // aborted. So if every sentinel, the leader among them, answered after the fence rose
        // (after the store heard) that it fails nothing over, the failover the fence was
        // raised for is over. The fence of a late promotion (its failover since undone by one
        // back to the master the store is on, whose switches the watch already knows) comes
        // down at the next look, not after the timeout (six minutes with Redis' default). A
        // failover that begins after these answers raises the fence again with its own
        // announcement, and the fence's count distrusts the writes answered in between
        // (`Fence::raised_since`).
        // Every sentinel: those the URL names and those they told of (a URL may name one
        // address for all, a Kubernetes Service in front of them, and the leader may be any;
        // see `every_sentinel_answered_since`). Where one does not answer, the timeout stays
        // the rule.
        let quiet_since_raised = quiet && self.every_sentinel_answered_since(views, fenced.raised);
        let given_up = !switched
            && quiet
            && (fenced.aborted
                || quiet_since_raised
                || fenced.raised.elapsed() > failover_timeout * 2 + ENDED_MARGIN);
        if !switched && !given_up {
            return;
        }
        let master = latest.master.clone();
        let asked = views.iter().map(|view| view.asked).min();
        if self.follow(&master).await && self.master_confirmed().await {
            if quiet {
                self.confirmed_at = asked;
            }
            let why = match switched {
                true => format!("the sentinels name the new master {master}, and the store is on it"),
                false => format!("the failover ended with no switch; the store is on the master {master}"),
            };
            self.lower(&why);
        }
    }

    /// Whether `views` hold an answer of every sentinel of the service, each asked after
    /// `since`: every asker answered (the URL's and those of the sentinels discovered), and
    /// they reach every sentinel, as counted after `since` (a sentinel added later is counted):
    /// either the URL names as many distinct addresses as the sentinels count themselves (its
    /// addresses are trusted to reach distinct sentinels, as [`discover`](Self::discover)
    /// trusts them when it listens to no other), or the sentinels' lists name that many
    /// addresses and each is asked, the URL's or a discovered sentinel's. The second trusts no
    /// URL address to reach any one sentinel: a Kubernetes Service may send each connection to
    /// another, so its answer may be any sentinel's, and only the announced addresses are
    /// counted.
    ///
    /// Why this cannot lower the fence of a failover still under way: only its leader
    /// announces the promotion and shows `failover_in_progress`, from before it announces
    /// until the switch or the abort; the others answer quiet throughout, whether or not they
    /// know of it yet, so their answers count for nothing but coverage. The leader is one of
    /// the sentinels the lists name: each sentinel lists those whose hellos it heard (sent
    /// every 2 s through the data nodes), and the leader had watched the master for
    /// `down-after-milliseconds` at least before it could fail it over (the lists are trusted:
    /// a sentinel whose hellos reach none of the others is not counted). So it is asked; if it
    /// answered quiet after the raise, the failover the fence was raised for is over. A
    /// sentinel discovered late (not in the lists when the fence rose, or not connected yet)
    /// is counted from the first list that names it, and until its asker answers the fence
    /// stands. A failover that begins after these answers announces its own promotion, which
    /// raises the fence again, and the fence's count distrusts the writes answered meanwhile.
    ///
    /// (The other remedy, letting renewals through a fence that stands over no failover,
    /// needs the same knowledge, that no failover is under way, and would leave claims refused
    /// for the whole timeout: lowering the fence once that is known frees both.)
    fn every_sentinel_answered_since(&self, views: &[MasterView], since: Instant) -> bool {
        let Some(census) = self.census.as_ref().filter(|census| census.asked > since) else {
            return false;
        };
        let mut named: Vec<&(String, u16)> = self.url_addresses.iter().collect();
        named.sort_unstable();
        named.dedup();
        let asked_at = |address: &(String, u16)| {
            named.contains(&address) || (self.discovered.iter()).any(|sentinel| sentinel.address == *address)
        };
        let mut announced: Vec<&(String, u16)> = census.announced.iter().collect();
        announced.sort_unstable();
        announced.dedup();
        let reaches_every_sentinel = named.len() >= census.count
            || (announced.len() >= census.count && announced.iter().all(|address| asked_at(address)));
        let askers = self.askers.len() + self.discovered.len();
        reaches_every_sentinel && views.len() == askers && views.iter().all(|view| view.asked > since)
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
        // `attempted` is kept: other sentinels' announcements of a switch tried and since
        // overtaken can still be on their way (heard together with the switch back, once the
        // links to the sentinels come back), and acting on them would fence the store again
        // over the right master and reconnect every client twenty times for a master since
        // killed, whose `ROLE` proves nothing. A later failover between the same two addresses
        // is followed by the looks, once a second, or by its own new text.
        if let Some(fenced) = self.fenced.take() {
            tracing::info!(
                "{why}: taking writes again, {:?} after the fence was raised",
                fenced.raised.elapsed()
            );
        }
        self.fence.lower();
    }

    /// The connections that ask the sentinels: the URL's, then the discovered ones'.
    fn every_asker(&self) -> impl Iterator<Item = &Client> {
        (self.askers.iter()).chain(self.discovered.iter().map(|sentinel| &sentinel.asker.0))
    }

    pub(super) fn clients(&self) -> Vec<Client> {
        self.targets
            .lock()
            .map(|clients| clients.clone())
            .unwrap_or_default()
    }

    /// Asks every sentinel connected now (the URL's and those discovered) what it names
    /// (`SENTINEL MASTER`), at once; the answers that came within [`ASK_TIMEOUT`].
    async fn ask(&self) -> Vec<MasterView> {
        let asking = (self.every_asker())
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use fred::clients::Client;
    use fred::types::config::{Config, ConnectionConfig, ReconnectPolicy};
    use fred::types::Builder;
    use tokio::time::Instant;

    use super::super::connections::{Discovered, SentinelClients};
    use super::super::events::{Address, Announcement, Event};
    use super::super::fence::Fence;
    use super::super::views::MasterView;
    use super::{Census, Quit, Watcher};

    const SWITCH: &str = "mymaster 127.0.0.1 7000 127.0.0.1 7001";

    /// A watch over `sentinels` URL addresses (each with an asker that never connects) and no
    /// client of the store: nothing it does reaches a server.
    fn watch_over(sentinels: &[u16]) -> (Watcher, Arc<Fence>) {
        let fence = Arc::new(Fence::default());
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let askers = (sentinels.iter())
            .map(|_| Builder::default_centralized().build().expect("a client"))
            .collect::<Vec<Client>>();
        let watcher = Watcher {
            subscribed: Arc::default(),
            targets: Arc::default(),
            fence: fence.clone(),
            subscribers: Vec::new(),
            askers,
            service: "mymaster".to_owned(),
            promotable_from: None,
            failover_timeout: None,
            known_epoch: 0,
            heard: true,
            fenced: None,
            followed: String::new(),
            switch_seen: String::new(),
            attempted: String::new(),
            confirmed_at: None,
            url_addresses: (sentinels.iter())
                .map(|port| ("127.0.0.1".to_owned(), *port))
                .collect(),
            url_subscribers: Vec::new(),
            factory: SentinelClients {
                template: Config::default(),
                connection: ConnectionConfig::default(),
                policy: ReconnectPolicy::default(),
            },
            events,
            listeners: Vec::new(),
            discovered: Vec::new(),
            heartbeat: None,
            pace: Arc::default(),
            census: None,
            looks: 0,
            discovered_once: false,
        };
        (watcher, fence)
    }

    /// What the sentinels told of one another, asked at `asked`: `count` of them, their lists
    /// naming `announced`.
    fn census(count: usize, announced: &[(&str, u16)], asked: Instant) -> Option<Census> {
        Some(Census {
            count,
            announced: (announced.iter())
                .map(|(host, port)| ((*host).to_owned(), *port))
                .collect(),
            asked,
        })
    }

    /// Has `watcher` listen to and ask the sentinels at `addresses`, as if the others had told
    /// of them (their connections never connect).
    fn discover_at(watcher: &mut Watcher, addresses: &[(&str, u16)]) {
        for (host, port) in addresses {
            let client = || Builder::default_centralized().build().expect("a client");
            watcher.discovered.push(Discovered {
                address: ((*host).to_owned(), *port),
                listener: tokio::spawn(async {}),
                subscriber: Quit(client()),
                asker: Quit(client()),
            });
        }
    }

    /// A quiet answer naming `127.0.0.1:7000`, asked at `asked`.
    fn quiet_view(asked: Instant) -> MasterView {
        MasterView {
            master: Address {
                host: "127.0.0.1".to_owned(),
                port: 7000,
            },
            epoch: 1,
            down_after: Duration::from_secs(5),
            failover_timeout: Duration::from_secs(180),
            last_ok: Duration::ZERO,
            troubled: false,
            in_failover: false,
            asked,
        }
    }

    /// The receive-time rule (`confirmed_at`): a switch received before the sentinels last
    /// answered that no failover is under way, and handled only after (it waited in the
    /// channel behind other announcements while a look ran), is news no longer: not acted on.
    /// The same switch received after that answer is acted on (the control): with no client to
    /// move, the watch raises its fence and gives the switch up as tried. From outside the
    /// crate this needs an announcement to reach the listener during a look and be handled
    /// after it, a race with the once-a-second tick that a test cannot win every time.
    #[tokio::test]
    async fn a_switch_received_before_the_sentinels_last_quiet_answer_is_not_acted_on() {
        let (mut watcher, fence) = watch_over(&[]);
        let received = Instant::now();
        watcher.confirmed_at = Some(received + Duration::from_millis(1));
        let switch = |received| Announcement {
            event: Event::Switched(SWITCH.to_owned()),
            received,
        };
        watcher.on_announcement(switch(received)).await;
        assert!(!fence.is_raised(), "a superseded switch raised the fence");
        assert!(
            watcher.attempted.is_empty() && watcher.followed.is_empty(),
            "a superseded switch was followed"
        );

        watcher
            .on_announcement(switch(received + Duration::from_millis(2)))
            .await;
        assert!(
            fence.is_raised(),
            "a switch received after the answer was not acted on"
        );
        assert_eq!(watcher.attempted, SWITCH);
    }

    /// The count [`Watcher::try_lower`] trusts quiet answers on: every sentinel the URL names
    /// answered after the fence rose, and the URL names as many distinct sentinels as they
    /// count themselves, counted after the fence rose too.
    #[tokio::test]
    async fn quiet_answers_count_only_if_every_sentinel_gave_one_after_the_fence_rose() {
        let (mut watcher, _) = watch_over(&[26379, 26380, 26381]);
        let raised = Instant::now();
        let later = raised + Duration::from_millis(10);
        let views = || (0..3).map(|_| quiet_view(later)).collect::<Vec<_>>();
        watcher.census = census(3, &[], later);
        assert!(watcher.every_sentinel_answered_since(&views(), raised));

        // One did not answer.
        assert!(!watcher.every_sentinel_answered_since(&views()[..2], raised));
        // One answered before the fence rose.
        let mut stale = views();
        stale[0].asked = raised - Duration::from_millis(1);
        assert!(!watcher.every_sentinel_answered_since(&stale, raised));
        // Counted before the fence rose, or never.
        watcher.census = census(3, &[], raised - Duration::from_millis(1));
        assert!(!watcher.every_sentinel_answered_since(&views(), raised));
        watcher.census = None;
        assert!(!watcher.every_sentinel_answered_since(&views(), raised));
        // A sentinel added since, which the URL does not name (the leader may be that one).
        watcher.census = census(4, &[], later);
        assert!(!watcher.every_sentinel_answered_since(&views(), raised));
        // A URL naming one sentinel twice names two of three.
        let (mut twice, _) = watch_over(&[26379, 26379, 26380]);
        twice.census = census(3, &[], later);
        assert!(!twice.every_sentinel_answered_since(&views(), raised));
    }

    /// Issue 36: the same count where the URL names one address for every sentinel (a
    /// Kubernetes Service in front of them). The sentinels discovered count too: once every
    /// address their lists name is asked and every asker answered after the fence rose, the
    /// fence of a late promotion can come down at the next look. Before, it stood 2 ×
    /// `failover-timeout` + 5 s there, holding renewals past a 30 s lease. The Service's own
    /// answer may be any sentinel's: only the announced addresses count towards the sentinels'
    /// number.
    #[tokio::test]
    async fn behind_one_address_quiet_answers_count_once_every_sentinel_discovered_gave_one() {
        const PODS: [(&str, u16); 3] = [("10.0.0.1", 26379), ("10.0.0.2", 26379), ("10.0.0.3", 26379)];
        let raised = Instant::now();
        let later = raised + Duration::from_millis(10);
        let views = |answers: usize| (0..answers).map(|_| quiet_view(later)).collect::<Vec<_>>();
        let (mut watcher, _) = watch_over(&[26379]);
        watcher.url_addresses = vec![("sentinels.svc".to_owned(), 26379)];
        watcher.census = census(3, &PODS, later);
        discover_at(&mut watcher, &PODS);
        // The Service's asker and the three pods'.
        assert!(watcher.every_sentinel_answered_since(&views(4), raised));

        // One asker did not answer (a discovered sentinel unreachable, or not connected yet).
        assert!(!watcher.every_sentinel_answered_since(&views(3), raised));
        // One answered before the fence rose.
        let mut stale = views(4);
        stale[3].asked = raised - Duration::from_millis(1);
        assert!(!watcher.every_sentinel_answered_since(&stale, raised));
        // Counted before the fence rose.
        watcher.census = census(3, &PODS, raised - Duration::from_millis(1));
        assert!(!watcher.every_sentinel_answered_since(&views(4), raised));
        // A fourth sentinel counted, which no list names yet (discovered late): the Service's
        // answer does not stand for it.
        watcher.census = census(4, &PODS, later);
        assert!(!watcher.every_sentinel_answered_since(&views(4), raised));
        // Only the sentinel behind the Service told its list (two pods, not itself), and the
        // Service's answer may be either of those: two addresses of three.
        let (mut one, _) = watch_over(&[26379]);
        one.url_addresses = vec![("sentinels.svc".to_owned(), 26379)];
        one.census = census(3, &PODS[1..], later);
        discover_at(&mut one, &PODS[1..]);
        assert!(!one.every_sentinel_answered_since(&views(3), raised));
        // A sentinel the lists name but not asked (no connection built for it).
        let (mut unasked, _) = watch_over(&[26379]);
        unasked.url_addresses = vec![("sentinels.svc".to_owned(), 26379)];
        unasked.census = census(3, &PODS, later);
        discover_at(&mut unasked, &PODS[1..]);
        assert!(!unasked.every_sentinel_answered_since(&views(3), raised));
        // The URL's address is one a sentinel announces (tests/redis_sentinel.rs's proxies):
        // asked through the URL's asker, the two others discovered.
        let (mut announced, _) = watch_over(&[26379]);
        announced.census = census(3, &[("127.0.0.1", 26379), PODS[1], PODS[2]], later);
        discover_at(&mut announced, &PODS[1..]);
        assert!(announced.every_sentinel_answered_since(&views(3), raised));
    }
}
