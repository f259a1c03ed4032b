//! What makes two requests "the same request" for one key.

use sha2::{Digest, Sha256};

/// A SHA-256 digest of the parts of a request that must match for a retry to be replayed.
///
/// The HTTP layer fingerprints the method, authority (or `Host`), path and query, `Content-Type`
/// and body. Queue
/// consumers fingerprint whatever identifies their message, usually its payload.
///
/// ```
/// use tower_idempotency::Fingerprint;
///
/// let a = Fingerprint::new([b"POST".as_slice(), b"/payments", b"{\"amount\":1}"]);
/// let b = Fingerprint::new([b"POST".as_slice(), b"/payments", b"{\"amount\":2}"]);
/// assert_ne!(a, b);
/// ```
///
/// A fingerprint may carry the [`PolicyTag`] of the policy it was made under
/// ([`FingerprintPolicy::fingerprint`](crate::FingerprintPolicy::fingerprint)'s do). The tag
/// never makes two fingerprints differ: two fingerprints are equal when their digests are. It
/// says why they differ: a store keeps it beside the digest, so that a request whose fingerprint
/// differs from the stored one, under another policy's tag, is answered
/// [`ClaimOutcome::PolicyMismatch`](crate::ClaimOutcome::PolicyMismatch) ("stored under another
/// fingerprint policy") rather than [`ClaimOutcome::Mismatch`](crate::ClaimOutcome::Mismatch)
/// ("another request").
#[derive(Clone, Copy, Debug)]
pub struct Fingerprint {
    digest: [u8; 32],
    /// The policy's tag, eight zeros for none: an `Option` would be a byte longer, and every
    /// keyed request's state holds a fingerprint (`http/service.rs` keeps that state under 1 KiB).
    policy: [u8; 8],
}

/// Equal digests are the same request, whatever policies made them: two policies that count
/// the same bytes of a request (the default and `media_type_only` on a bare
/// `application/json`) replay each other's records, as before tags existed.
impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.digest == other.digest
    }
}

impl Eq for Fingerprint {}

impl std::hash::Hash for Fingerprint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.digest.hash(state);
    }
}

/// Eight bytes naming the policy a [`Fingerprint`] was made under (which parts of a request
/// count, and how), kept beside the fingerprint in the record: a store compares the tags of two
/// fingerprints that differ, to tell a request stored under another policy from another request.
///
/// ```
/// use tower_idempotency::{Fingerprint, PolicyTag};
///
/// let v1 = PolicyTag::new([b"orders-v1".as_slice()]);
/// let v2 = PolicyTag::new([b"orders-v2".as_slice()]);
/// assert_ne!(v1, v2);
/// let fingerprint = Fingerprint::new([b"payload".as_slice()]).with_policy(v1);
/// assert_eq!(fingerprint.policy(), Some(v1));
/// // The tag explains a difference, it never makes one.
/// assert_eq!(fingerprint, Fingerprint::new([b"payload".as_slice()]).with_policy(v2));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct PolicyTag([u8; 8]);

impl PolicyTag {
    /// The tag of a policy described by `parts` (length-prefixed, as a fingerprint's): the
    /// first 8 bytes of their SHA-256. Never all zeros, which stores write for "no tag".
    pub fn new<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        Self::of(&Fingerprint::new(parts))
    }

    /// The tag of a policy whose description's digest is `description`.
    pub(crate) fn of(description: &Fingerprint) -> Self {
        let mut tag = [0; 8];
        tag.copy_from_slice(&description.digest[..8]);
        Self::from_bytes(tag).unwrap_or(Self([0, 0, 0, 0, 0, 0, 0, 1]))
    }

    /// A tag as a store kept it; `None` for the eight zeros that stand for no tag.
    pub fn from_bytes(bytes: [u8; 8]) -> Option<Self> {
        (bytes != [0; 8]).then_some(Self(bytes))
    }

    /// The tag's bytes, as a store keeps them.
    pub fn as_bytes(&self) -> &[u8; 8] {
        &self.0
    }

    /// The bytes a store keeps for `tag`: its own, or eight zeros for none.
    pub fn stored(tag: Option<PolicyTag>) -> [u8; 8] {
        tag.map_or([0; 8], |tag| tag.0)
    }
}

impl Fingerprint {
    /// Digests the parts in order. Each part is length-prefixed, so moving bytes from one part
    /// to the next changes the fingerprint.
    pub fn new<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut builder = FingerprintBuilder::default();
        for part in parts {
            builder.part(part);
        }
        builder.finish()
    }

    /// Wraps a digest computed elsewhere (for example a stored one), with no policy tag.
    pub fn from_digest(digest: [u8; 32]) -> Self {
        Self {
            digest,
            policy: [0; 8],
        }
    }

    /// The same fingerprint, made under the policy `tag` names.
    pub fn with_policy(mut self, tag: PolicyTag) -> Self {
        self.policy = tag.0;
        self
    }

    /// The policy this fingerprint was made under, if it says.
    pub fn policy(&self) -> Option<PolicyTag> {
        PolicyTag::from_bytes(self.policy)
    }

    /// Whether a record stored with `stored` (its fingerprint's tag) and a fingerprint other
    /// than this one was made under another policy than this one: both carry a tag, and the
    /// tags differ. A record without one (written before tags, or by a caller that gives none)
    /// is never said to be: the plain mismatch stays.
    pub fn policy_differs(&self, stored: Option<PolicyTag>) -> bool {
        matches!((self.policy(), stored), (Some(ours), Some(theirs)) if ours != theirs)
    }

    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.digest
    }
}

/// A [`Fingerprint`] digested part by part, for callers whose number of parts is only known as
/// they go (selected headers, each value a part); the same parts give the same digest as
/// [`Fingerprint::new`].
#[derive(Default)]
pub(crate) struct FingerprintBuilder(Sha256);

impl FingerprintBuilder {
    pub(crate) fn part(&mut self, part: &[u8]) {
        self.0.update((part.len() as u64).to_be_bytes());
        self.0.update(part);
    }

    pub(crate) fn finish(self) -> Fingerprint {
        Fingerprint::from_digest(self.0.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Two lists of parts share a fingerprint only if they are the same parts: moving
        /// bytes across a boundary, or adding an empty part, changes it; built part by part it
        /// is the same.
        #[test]
        fn fingerprints_are_equal_only_for_equal_parts(
            a in proptest::collection::vec(proptest::collection::vec(0u8..3, 0..3), 0..4),
            b in proptest::collection::vec(proptest::collection::vec(0u8..3, 0..3), 0..4),
        ) {
            let of = |parts: &[Vec<u8>]| Fingerprint::new(parts.iter().map(Vec::as_slice));
            prop_assert_eq!(of(&a) == of(&b), a == b);
            let mut builder = FingerprintBuilder::default();
            for part in &a {
                builder.part(part);
            }
            prop_assert_eq!(builder.finish(), of(&a));
            prop_assert_eq!(Fingerprint::from_digest(*of(&a).as_bytes()), of(&a));
        }
    }
}
