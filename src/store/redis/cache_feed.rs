//! A replay cache's invalidation feed: the purges published on the store's channel, heard over a
//! connection of the cache's own, and what the cache does while that feed may be missing some.

use std::sync::Arc;

use fred::clients::Client;
use fred::interfaces::{EventInterface, PubsubInterface};

use super::liveness;
use super::record::digest_from_hex;

use crate::replay_cache::ReplayCache;
use crate::telemetry::{self, Connection as Role, ConnectionEvent};

/// A replay cache's invalidation feed: the purges published on `channel`, heard over
/// `subscriber`, a connection of the cache's own.
pub(super) struct PurgeFeed {
    pub(super) subscriber: Client,
    pub(super) channel: String,
    pub(super) cache: Arc<ReplayCache>,
    /// Changes each time the heartbeat finds the subscriber silent.
    pub(super) silences: tokio::sync::watch::Receiver<u64>,
}

impl PurgeFeed {
    /// Feeds the cache the purges. Whenever the feed may have missed one (the connection failed,
    /// went silent, or came back) the cache goes dark, serving nothing, until the subscription is
    /// confirmed on a live connection; it then starts empty.
    pub(super) async fn listen(mut self) {
        use tokio::sync::broadcast::error::RecvError;

        let mut messages = self.subscriber.message_rx();
        let mut errors = self.subscriber.error_rx();
        let mut reconnects = self.subscriber.reconnect_rx();
        let mut live = true;
        loop {
            let resubscribe = tokio::select! {
                message = messages.recv() => match message {
                    Ok(message) if *message.channel == *self.channel => {
                        let digest = message.value.as_bytes().and_then(digest_from_hex);
                        match digest {
                            Some(digest) => self.cache.invalidate(&digest),
                            None => tracing::warn!(?message.value, "unreadable message on the purge channel; ignored"),
                        }
                        false
                    }
                    Ok(_) => false,
                    Err(RecvError::Lagged(_)) => {
                        tracing::warn!("replay cache fell behind on purges; dropping every copy");
                        self.cache.set_live(false);
                        self.cache.set_live(live);
                        false
                    }
                    Err(RecvError::Closed) => {
                        self.cache.set_live(false);
                        return;
                    }
                },
                // An error may be stale by the time it is read (from before a reconnection): the
                // subscription is checked again rather than the cache left dark on its word.
                _ = errors.recv() => true,
                // Also after the heartbeat replaced a silent connection.
                _ = reconnects.recv() => true,
                silenced = self.silences.changed() => {
                    if silenced.is_err() {
                        self.cache.set_live(false);
                        return;
                    }
                    self.go_dark(&mut live);
                    false // the heartbeat is replacing the connection; its reconnection resubscribes
                }
            };
            if resubscribe {
                self.go_dark(&mut live);
                errors = errors.resubscribe();
                let subscribed = tokio::time::timeout(
                    liveness::SUBSCRIBE_TIMEOUT,
                    self.subscriber.subscribe(self.channel.clone()),
                )
                .await;
                match subscribed {
                    Ok(Ok(())) => {
                        self.cache.set_live(true);
                        live = true;
                        tracing::info!("the replay cache hears purges again; it starts empty");
                        telemetry::connection_event(Role::ReplayCache, ConnectionEvent::FeedBack);
                    }
                    Ok(Err(error)) => tracing::warn!(%error, "the replay cache cannot listen for purges; it serves nothing until it can"),
                    Err(_) => tracing::warn!("the replay cache's subscription went unanswered; it serves nothing until its connection is replaced"),
                }
            }
        }
    }

    /// Stops serving copies: purges may be missed from now on.
    fn go_dark(&self, live: &mut bool) {
        self.cache.set_live(false);
        if std::mem::replace(live, false) {
            tracing::warn!("the replay cache's purge feed is down; it serves nothing until the feed is back");
            telemetry::connection_event(Role::ReplayCache, ConnectionEvent::FeedLost);
        }
    }
}
