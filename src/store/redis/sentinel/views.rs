//! What a sentinel answers of its master (`SENTINEL MASTER`), and what the watch reads from it.

use std::time::Duration;

use fred::types::Value;
use tokio::time::Instant;

use super::events::Address;

/// Redis's own default `failover-timeout`, assumed while the sentinels' cannot be read.
pub(super) const DEFAULT_FAILOVER_TIMEOUT: Duration = Duration::from_secs(180);

/// What one sentinel said of the service (`SENTINEL MASTER <service>`), and when.
#[derive(Debug)]
pub(super) struct MasterView {
    pub(super) master: Address,
    /// Bumped by every switch: of two views, the higher names the later master.
    pub(super) epoch: u64,
    pub(super) down_after: Duration,
    pub(super) failover_timeout: Duration,
    /// How long before the answer the sentinel last had a valid reply from the master.
    pub(super) last_ok: Duration,
    /// The sentinel thinks the master down (`s_down`, `o_down`) or is failing it over.
    pub(super) troubled: bool,
    /// The sentinel is failing the master over (`failover_in_progress`).
    pub(super) in_failover: bool,
    pub(super) asked: Instant,
}

impl MasterView {
    /// Reads the field list `SENTINEL MASTER` answers (an array of names and values in RESP2, a
    /// map in RESP3); `None` if a field the watch needs is missing.
    pub(super) fn parse(answer: Value, asked: Instant) -> Option<Self> {
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
    pub(super) fn promotable_from(&self) -> Instant {
        if self.troubled {
            return self.asked;
        }
        (self.asked.checked_sub(self.last_ok))
            .unwrap_or(self.asked)
            .checked_add(self.down_after)
            .unwrap_or(self.asked)
    }
}

/// The names and values of a sentinel's description of an instance: an array of names and
/// values in turn in RESP2, a map in RESP3.
pub(super) fn fields(answer: Value) -> Option<Vec<(String, String)>> {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use fred::types::Value;
    use tokio::time::Instant;

    use super::super::events::Address;
    use super::MasterView;

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

    /// A healthy master cannot be promoted away before `down-after-milliseconds` after the
    /// sentinel last heard it; one it thinks down, or is failing over, at once.
    #[test]
    fn the_earliest_promotion_is_read_from_the_sentinels_answer() {
        let asked = Instant::now();
        let healthy = MasterView::parse(answer("master", 400), asked).expect("a full answer");
        assert_eq!(
            healthy.master,
            Address {
                host: "10.0.0.1".to_owned(),
                port: 7000
            }
        );
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
