//! What makes two HTTP requests the same request: [`FingerprintPolicy`], and the fingerprint the
//! layer computes from it.

use std::borrow::Cow;

use http::header::{HeaderName, CONTENT_TYPE, HOST};
use http::request;

use crate::canonical_json::{self, JsonPointer};
use crate::fingerprint::{Fingerprint, FingerprintBuilder, PolicyTag};

/// Which parts of a request count in its fingerprint, so that a retry that differs only in
/// parts that do not count replays, and one that differs in a counted part is a mismatch.
///
/// The default counts the method, the authority (the URI's, else `Host`, normalised), the path
/// and query, the whole `Content-Type` and the body: the fingerprint of every request is then
/// exactly the one earlier releases computed, so their records still replay. Each builder
/// method changes one part:
///
/// ```
/// use http::HeaderName;
/// use tower_idempotency::{FingerprintPolicy, IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_fingerprint(
///     FingerprintPolicy::new()
///         .media_type_only()                                   // `charset` and other parameters ignored
///         .with_header(HeaderName::from_static("x-account-id")), // and this header counted too
/// );
/// # let _ = layer;
/// ```
///
/// A JSON body can count by its meaning rather than its bytes ([`json_body`](Self::json_body)),
/// all of it or only some members ([`json_body_only`](Self::json_body_only),
/// [`json_body_except`](Self::json_body_except)).
///
/// Changing an endpoint's policy changes the fingerprint of requests that differ in the parts
/// changed: a retry across that deploy may then be answered as a mismatch. A JSON policy's
/// fingerprints carry the policy itself (which members count), so a record made under one JSON
/// policy, or under a bytes policy, is a mismatch under another, never a replay.
///
/// Every fingerprint also carries the policy's [`PolicyTag`], which stores keep beside it: a
/// request whose fingerprint differs from a record's stored under another policy is answered
/// [`Rejection::PolicyMismatch`](crate::Rejection::PolicyMismatch) ("stored under another
/// fingerprint policy"), not [`Rejection::Mismatch`](crate::Rejection::Mismatch) ("another
/// request"). The tag never decides a replay: equal fingerprints replay whatever their tags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FingerprintPolicy {
    pub(crate) content_type: ContentTypePart,
    pub(crate) headers: Vec<HeaderName>,
    pub(crate) body: BodyPart,
    /// The tag of the three fields above, made again by every builder method: a request pays
    /// for none.
    tag: PolicyTag,
}

/// How the body counts.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub(crate) enum BodyPart {
    /// Its bytes as sent (the default, as earlier releases).
    #[default]
    Bytes,
    /// Not at all.
    Ignored,
    /// By its meaning as JSON (RFC 8785), these members of it.
    Json(JsonMembers),
}

/// Which members of a JSON body count; pointers sorted and without repeats, so that the order
/// they were given in does not change the fingerprint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum JsonMembers {
    All,
    Only(Vec<JsonPointer>),
    Except(Vec<JsonPointer>),
}

/// The first part of every JSON policy's fingerprint: a NUL cannot be in a method, the first
/// part of every other fingerprint, so no JSON fingerprint's parts can be a bytes policy's.
/// The `1` names this canonical form and layout: change either, and it must change too.
const JSON_POLICY: &[u8] = b"\0json-jcs-1";

/// How `Content-Type` counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum ContentTypePart {
    /// The header's bytes as sent (the default, as earlier releases).
    #[default]
    Full,
    /// The media type alone, lower-cased: `application/json; charset=utf-8` is `application/json`.
    MediaType,
    /// Not at all.
    Ignored,
}

impl Default for FingerprintPolicy {
    fn default() -> Self {
        let (content_type, headers, body) = (ContentTypePart::Full, Vec::new(), BodyPart::Bytes);
        Self {
            tag: tag_of(content_type, &headers, &body),
            content_type,
            headers,
            body,
        }
    }
}

/// The first part of every policy's description, for its tag: the `1` names this description's
/// layout, which must change with it (a changed description changes every tag, and records
/// stored before would then read as made under another policy).
const POLICY_DESCRIPTION: &[u8] = b"tower-idempotency-fingerprint-policy-1";

impl FingerprintPolicy {
    /// The default: method, authority, path and query, `Content-Type` as sent, and the body.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts only the media type of `Content-Type`, compared case-insensitively; its
    /// parameters (`charset`, `boundary`, ...) do not count.
    ///
    /// ```
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().media_type_only();
    /// # let _ = policy;
    /// ```
    pub fn media_type_only(self) -> Self {
        self.retagged(|policy| policy.content_type = ContentTypePart::MediaType)
    }

    /// `Content-Type` does not count at all.
    ///
    /// ```
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().without_content_type();
    /// # let _ = policy;
    /// ```
    pub fn without_content_type(self) -> Self {
        self.retagged(|policy| policy.content_type = ContentTypePart::Ignored)
    }

    /// Counts a request header too: its absence, and each of its values in order. Headers
    /// are counted in the order they were added; adding one twice counts it once.
    ///
    /// ```
    /// # use http::HeaderName;
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().with_header(HeaderName::from_static("x-account-id"));
    /// # let _ = policy;
    /// ```
    pub fn with_header(self, name: HeaderName) -> Self {
        self.retagged(|policy| {
            if !policy.headers.contains(&name) {
                policy.headers.push(name);
            }
        })
    }

    /// The body does not count (it is still read, up to the body limit, and handed on). For
    /// endpoints whose body varies between retries of one operation (a client-side timestamp,
    /// a signature), where the key alone names the operation.
    ///
    /// ```
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().without_body();
    /// # let _ = policy;
    /// ```
    pub fn without_body(self) -> Self {
        self.retagged(|policy| policy.body = BodyPart::Ignored)
    }

    /// The body counts by its meaning as JSON, not its bytes: key order, whitespace, escapes
    /// and the spelling of numbers (`1.50`, `15e-1`) do not matter. Two bodies count alike when
    /// their RFC 8785 (JSON Canonicalization Scheme) forms are the same.
    ///
    /// Only a body whose `Content-Type` is JSON (`application/json`, or `+json` such as
    /// `application/merge-patch+json`) and that is I-JSON (RFC 7493) counts this way. Any
    /// other body counts by its bytes, all of them: one that is not UTF-8 or not JSON, names a
    /// member twice (parsers disagree on which one a handler sees), nests deeper than 128, or
    /// holds a number that a double does not hold exactly as written (JCS would round
    /// `0.10000000000000000001` to `0.1`, and a handler reading decimals would see two requests
    /// as one). Such a body is logged at `DEBUG`; it is never a pass.
    ///
    /// ```
    /// # use tower_idempotency::{FingerprintPolicy, IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_fingerprint(FingerprintPolicy::new().json_body());
    /// # let _ = layer;
    /// ```
    pub fn json_body(self) -> Self {
        self.retagged(|policy| policy.body = BodyPart::Json(JsonMembers::All))
    }

    /// As [`json_body`](Self::json_body), but only the values these JSON Pointers (RFC 6901)
    /// refer to count, each by its canonical form or its absence (a `null` is not an absent
    /// member); nothing else in the body does. The order of the pointers does not matter.
    ///
    /// Choose every member that makes the operation what it is: a body that differs only in
    /// members not chosen replays the first one's response.
    ///
    /// ```
    /// # use tower_idempotency::{FingerprintPolicy, JsonPointer};
    /// let policy = FingerprintPolicy::new().json_body_only([
    ///     JsonPointer::parse("/amount")?,
    ///     JsonPointer::parse("/currency")?,
    ///     JsonPointer::parse("/beneficiary/iban")?,
    /// ]);
    /// # let _ = policy;
    /// # Ok::<(), tower_idempotency::InvalidJsonPointer>(())
    /// ```
    pub fn json_body_only(self, pointers: impl IntoIterator<Item = JsonPointer>) -> Self {
        self.retagged(|policy| policy.body = BodyPart::Json(JsonMembers::Only(sorted(pointers))))
    }

    /// As [`json_body`](Self::json_body), but the values these JSON Pointers refer to do not
    /// count (a client's timestamp, a trace id): a member is left out, an array's element is
    /// left out in place (the elements after it keep their indices).
    ///
    /// ```
    /// # use tower_idempotency::{FingerprintPolicy, JsonPointer};
    /// let policy = FingerprintPolicy::new().json_body_except([
    ///     JsonPointer::parse("/sent_at")?,
    ///     JsonPointer::parse("/meta/trace_id")?,
    /// ]);
    /// # let _ = policy;
    /// # Ok::<(), tower_idempotency::InvalidJsonPointer>(())
    /// ```
    pub fn json_body_except(self, pointers: impl IntoIterator<Item = JsonPointer>) -> Self {
        self.retagged(|policy| policy.body = BodyPart::Json(JsonMembers::Except(sorted(pointers))))
    }

    /// The fingerprint of a request with this policy, as the layer computes it: to compute one
    /// outside the layer (a test, a benchmark, a tool that checks a stored record).
    ///
    /// The default policy's parts are exactly those of earlier releases, in the same order;
    /// the options only change a part's bytes (`Content-Type`, body) or add parts after them
    /// (headers); a JSON policy's begin with parts that name it.
    ///
    /// ```
    /// # use tower_idempotency::FingerprintPolicy;
    /// let request = http::Request::post("/payments")
    ///     .header("content-type", "application/json")
    ///     .body(())?
    ///     .into_parts()
    ///     .0;
    /// let json = FingerprintPolicy::new().json_body();
    /// assert_eq!(
    ///     json.fingerprint(&request, br#"{"amount":42,"currency":"EUR"}"#),
    ///     json.fingerprint(&request, br#"{ "currency": "EUR", "amount": 42.0 }"#),
    /// );
    /// # Ok::<(), http::Error>(())
    /// ```
    pub fn fingerprint(&self, parts: &request::Parts, body: &[u8]) -> Fingerprint {
        let authority = match parts.uri.authority() {
            Some(authority) => authority.as_str().as_bytes(),
            None => parts.headers.get(HOST).map_or(&[][..], |v| v.as_bytes()),
        };
        let authority = normalized_authority(authority);
        let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let content_type = parts.headers.get(CONTENT_TYPE).map_or(&[][..], |v| v.as_bytes());
        let mut fingerprint = FingerprintBuilder::default();
        if let BodyPart::Json(members) = &self.body {
            members.describe(&mut fingerprint);
        }
        fingerprint.part(parts.method.as_str().as_bytes());
        fingerprint.part(&authority);
        fingerprint.part(path_and_query.as_bytes());
        match self.content_type {
            ContentTypePart::Full => fingerprint.part(content_type),
            ContentTypePart::MediaType => fingerprint.part(&media_type(content_type)),
            ContentTypePart::Ignored => fingerprint.part(&[]),
        }
        match &self.body {
            BodyPart::Bytes => fingerprint.part(body),
            BodyPart::Ignored => fingerprint.part(&[]),
            BodyPart::Json(members) => members.digest(content_type, body, &mut fingerprint),
        }
        for name in &self.headers {
            // The count of values first, so that values of one header can never read as the
            // name or values of the next.
            let values = parts.headers.get_all(name);
            fingerprint.part(name.as_str().as_bytes());
            fingerprint.part(&(values.iter().count() as u64).to_be_bytes());
            for value in values {
                fingerprint.part(value.as_bytes());
            }
        }
        fingerprint.finish().with_policy(self.tag)
    }

    /// The tag of this policy, kept beside every fingerprint made under it.
    pub fn tag(&self) -> PolicyTag {
        self.tag
    }

    /// This policy, changed by `change`, with its tag made again from what counts.
    fn retagged(mut self, change: impl FnOnce(&mut Self)) -> Self {
        change(&mut self);
        self.tag = tag_of(self.content_type, &self.headers, &self.body);
        self
    }
}

/// The tag of a policy: every part of it, in a fixed order (headers in the order they count,
/// pointers sorted).
fn tag_of(content_type: ContentTypePart, headers: &[HeaderName], body: &BodyPart) -> PolicyTag {
    let mut description = FingerprintBuilder::default();
    description.part(POLICY_DESCRIPTION);
    description.part(match content_type {
        ContentTypePart::Full => b"content-type",
        ContentTypePart::MediaType => b"media-type",
        ContentTypePart::Ignored => b"no-content-type",
    });
    match body {
        BodyPart::Bytes => description.part(b"body-bytes"),
        BodyPart::Ignored => description.part(b"no-body"),
        BodyPart::Json(members) => members.describe(&mut description),
    }
    description.part(&(headers.len() as u64).to_be_bytes());
    for name in headers {
        description.part(name.as_str().as_bytes());
    }
    PolicyTag::of(&description.finish())
}

fn sorted(pointers: impl IntoIterator<Item = JsonPointer>) -> Vec<JsonPointer> {
    let mut pointers: Vec<_> = pointers.into_iter().collect();
    pointers.sort();
    pointers.dedup();
    pointers
}

impl JsonMembers {
    /// The policy, as the fingerprint's first parts: which members count.
    fn describe(&self, fingerprint: &mut FingerprintBuilder) {
        fingerprint.part(JSON_POLICY);
        let (kind, pointers): (&[u8], &[JsonPointer]) = match self {
            JsonMembers::All => (b"all", &[]),
            JsonMembers::Only(pointers) => (b"only", pointers),
            JsonMembers::Except(pointers) => (b"except", pointers),
        };
        fingerprint.part(kind);
        fingerprint.part(&(pointers.len() as u64).to_be_bytes());
        for pointer in pointers {
            let tokens = pointer.tokens();
            fingerprint.part(&(tokens.len() as u64).to_be_bytes());
            for token in tokens {
                fingerprint.part(token.as_bytes());
            }
        }
    }

    /// The body's parts: `jcs` and the canonical form of each value that counts, or `bytes`
    /// and the body as sent when it has no canonical form (see `json_body`).
    fn digest(&self, content_type: &[u8], body: &[u8], fingerprint: &mut FingerprintBuilder) {
        let parsed = if is_json_media_type(content_type) {
            canonical_json::parse(body, true).map_err(canonical_json::NotCanonical::as_str)
        } else {
            Err("its Content-Type is not JSON")
        };
        let mut json = match parsed {
            Ok(json) => json,
            Err(why) => {
                tracing::debug!(target: "tower_idempotency", why, "the JSON fingerprint counts this body by its bytes");
                fingerprint.part(b"bytes");
                fingerprint.part(body);
                return;
            }
        };
        fingerprint.part(b"jcs");
        let mut canonical = Vec::with_capacity(body.len());
        match self {
            JsonMembers::Only(pointers) => {
                // An absent value is an empty part: every canonical form has a byte at least.
                for pointer in pointers {
                    canonical.clear();
                    if let Some(value) = json.get(pointer) {
                        value.write_canonical(&mut canonical);
                    }
                    fingerprint.part(&canonical);
                }
                return;
            }
            JsonMembers::All => {}
            JsonMembers::Except(pointers) => pointers.iter().for_each(|pointer| json.exclude(pointer)),
        }
        json.write_canonical(&mut canonical);
        fingerprint.part(&canonical);
    }
}

/// `application/json`, or a `+json` type (RFC 6839), in any case, with any parameters.
fn is_json_media_type(content_type: &[u8]) -> bool {
    let media = media_type(content_type);
    &*media == b"application/json" || (media.ends_with(b"+json") && media.contains(&b'/'))
}

/// The media type of a `Content-Type` value: before any `;`, trimmed, lower-cased (RFC 9110
/// §8.3.1: type and subtype are case-insensitive).
fn media_type(value: &[u8]) -> Cow<'_, [u8]> {
    let end = value.iter().position(|&b| b == b';').unwrap_or(value.len());
    let media = value[..end].trim_ascii();
    if media.iter().any(u8::is_ascii_uppercase) {
        Cow::Owned(media.to_ascii_lowercase())
    } else {
        Cow::Borrowed(media)
    }
}

/// `host[:port]` as DNS and HTTP treat it: host names are case-insensitive, `example.com.` is
/// `example.com`, and `:80` and `:443` are the default ports (the layer cannot tell the scheme, and
/// a server answers one of them per name). Borrows when there is nothing to change, as for nearly
/// every request.
pub(crate) fn normalized_authority(raw: &[u8]) -> Cow<'_, [u8]> {
    // Split off the port: after the last `:`, unless that `:` is inside an IPv6 literal.
    let (host, port) = match raw.iter().rposition(|&b| b == b':') {
        Some(colon) if !raw[colon..].contains(&b']') && raw[colon + 1..].iter().all(u8::is_ascii_digit) => {
            (&raw[..colon], Some(&raw[colon + 1..]))
        }
        _ => (raw, None),
    };
    let port = port.filter(|port| *port != b"80" && *port != b"443");
    let host = host.strip_suffix(b".").unwrap_or(host);
    let unchanged = host.len() + port.map_or(0, |p| p.len() + 1) == raw.len();
    if unchanged && !host.iter().any(u8::is_ascii_uppercase) {
        return Cow::Borrowed(raw);
    }
    let mut normalized = host.to_ascii_lowercase();
    if let Some(port) = port {
        normalized.push(b':');
        normalized.extend_from_slice(port);
    }
    Cow::Owned(normalized)
}

/// The fuzz target's check of the fingerprint's normalisation (`fuzz/fuzz_targets/fingerprint.rs`,
/// and `tests/fuzz_corpora.rs` on every checked-in input): the first line is an authority (or
/// `Host`), the second a `Content-Type`, the third a request target. Normalising never panics,
/// ignores ASCII case, only takes away (a trailing dot, a default port) and, for a host with
/// no empty label and one port at most, is the same done twice; a media type is the same with
/// parameters added; a request's fingerprint ignores the case of its authority and `Host`.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) {
    let mut lines = data.splitn(3, |b| *b == b'\n');
    let authority = lines.next().unwrap_or_default();
    let content_type = lines.next().unwrap_or_default();
    let target = lines.next().unwrap_or_default();

    let normalized = normalized_authority(authority);
    assert_eq!(*normalized, normalized.to_ascii_lowercase());
    assert_eq!(normalized, normalized_authority(&authority.to_ascii_uppercase()));
    let lower = authority.to_ascii_lowercase();
    let mut rest = lower.iter();
    assert!(
        normalized.iter().all(|b| rest.any(|c| c == b)),
        "{normalized:?} is not {authority:?} with parts taken away"
    );
    // `host[:digits]`, the host a name with no empty label or an IPv6 literal: the `http`
    // crate takes more (`a.:.`), whose dot and colon normalisation may read differently twice.
    let host_end = match authority.first() {
        Some(b'[') => authority.iter().position(|b| *b == b']').map(|end| end + 1),
        _ => Some(
            authority
                .iter()
                .position(|b| *b == b':')
                .unwrap_or(authority.len()),
        ),
    };
    let well_formed = host_end.is_some_and(|end| {
        let (host, port) = authority.split_at(end);
        !host.is_empty()
            && !host.starts_with(b".")
            && !host.windows(2).any(|w| w == b"..")
            && port.first().is_none_or(|colon| *colon == b':')
            && port.iter().skip(1).all(u8::is_ascii_digit)
    });
    if well_formed {
        assert_eq!(normalized_authority(&normalized), normalized, "{authority:?}");
    }

    let media = media_type(content_type);
    assert_eq!(media_type(&media), media);
    if !content_type.contains(&b';') {
        assert_eq!(media_type(&[content_type, b"; charset=utf-8"].concat()), media);
    }

    let (Ok(target), Ok(host)) = (
        http::Uri::try_from(target),
        http::HeaderValue::from_bytes(authority),
    ) else {
        return;
    };
    let request = |target: http::Uri, host: http::HeaderValue| {
        let mut request = http::Request::new(());
        *request.uri_mut() = target;
        request.headers_mut().insert(HOST, host);
        request.into_parts().0
    };
    let shouted = |uri: &http::Uri| {
        let mut parts = uri.clone().into_parts();
        parts.authority = parts
            .authority
            .and_then(|a| a.as_str().to_ascii_uppercase().parse().ok());
        http::Uri::from_parts(parts).ok()
    };
    let policy = FingerprintPolicy::new();
    let fingerprint = policy.fingerprint(&request(target.clone(), host.clone()), b"");
    let loud_host = http::HeaderValue::from_bytes(&authority.to_ascii_uppercase()).expect("still a value");
    if let Some(loud_target) = shouted(&target) {
        assert_eq!(
            fingerprint,
            policy.fingerprint(&request(loud_target, loud_host), b"")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(request: Request<()>) -> request::Parts {
        request.into_parts().0
    }

    fn hex(fingerprint: &Fingerprint) -> String {
        crate::key::hex(fingerprint.as_bytes())
    }

    /// The default fingerprint is the one earlier releases computed and stored: the same five
    /// parts in the same order, and the same digest (pinned here, computed independently as
    /// SHA-256 over each part's big-endian u64 length and bytes).
    #[test]
    fn the_default_fingerprint_is_byte_identical_to_earlier_releases() {
        let request = parts(
            Request::post("/payments?x=1")
                .header("host", "API.Example.com.:443")
                .header("content-type", "application/json; charset=utf-8")
                .body(())
                .unwrap(),
        );
        let body = br#"{"amount":42}"#;
        let computed = FingerprintPolicy::new().fingerprint(&request, body);
        let earlier = Fingerprint::new([
            b"POST".as_slice(),
            b"api.example.com",
            b"/payments?x=1",
            b"application/json; charset=utf-8",
            body,
        ]);
        assert_eq!(computed, earlier);
        assert_eq!(
            hex(&computed),
            "660ec80aa86dca72934ec43e43b50a07c61b0beec69275483b1a179574efecec",
            "the digest of the default fingerprint changed: records of earlier releases would mismatch"
        );
    }

    /// Beyond `media_types_ignore_parameters_and_case`: no copy, and two types apart.
    #[test]
    fn media_type_only_ignores_parameters_and_case() {
        assert!(matches!(media_type(b"application/json"), Cow::Borrowed(_)));
        let policy = FingerprintPolicy::new().media_type_only();
        let with = |ct: &str| {
            let request = parts(Request::post("/p").header("content-type", ct).body(()).unwrap());
            policy.fingerprint(&request, b"{}")
        };
        assert_ne!(with("application/json"), with("text/plain"));
    }

    #[test]
    fn header_values_never_read_as_the_next_header() {
        let policy = FingerprintPolicy::new()
            .with_header(HeaderName::from_static("x-a"))
            .with_header(HeaderName::from_static("x-b"));
        let a = parts(Request::post("/p").header("x-a", "x-b").body(()).unwrap());
        let b = parts(Request::post("/p").header("x-b", "x-b").body(()).unwrap());
        assert_ne!(policy.fingerprint(&a, b""), policy.fingerprint(&b, b""));
        let empty = parts(Request::post("/p").header("x-a", "").body(()).unwrap());
        let absent = parts(Request::post("/p").body(()).unwrap());
        assert_ne!(policy.fingerprint(&empty, b""), policy.fingerprint(&absent, b""));
    }

    #[test]
    fn authorities_that_name_the_same_host_normalise_alike() {
        let norm = |raw: &str| String::from_utf8(normalized_authority(raw.as_bytes()).into_owned()).unwrap();
        for same in [
            "API.Example.com",
            "api.example.com.",
            "api.example.com:443",
            "Api.Example.Com.:80",
        ] {
            assert_eq!(norm(same), "api.example.com", "{same}");
        }
        assert_eq!(norm("api.example.com:8080"), "api.example.com:8080");
        assert_eq!(norm("API.example.com.:8443"), "api.example.com:8443");
        assert_eq!(norm("[::1]:443"), "[::1]");
        assert_eq!(norm("[::1]"), "[::1]");
        assert_eq!(norm("[2001:DB8::1]:8080"), "[2001:db8::1]:8080");
        assert_eq!(norm(""), "");
        assert!(matches!(
            normalized_authority(b"api.example.com:8080"),
            Cow::Borrowed(_)
        ));
    }

    fn json_request() -> request::Parts {
        parts(
            Request::post("/payments")
                .header("content-type", "application/json")
                .body(())
                .unwrap(),
        )
    }

    /// Two values the same as JSON: equal canonical forms (serde_json's `Value` tells `0` from
    /// `0.0`).
    fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
        let canonical =
            |v: &serde_json::Value| crate::canonical_json::canonicalize(&serde_json::to_vec(v).unwrap());
        canonical(a) == canonical(b)
    }

    #[test]
    fn a_json_body_counts_by_its_meaning_and_other_bodies_by_their_bytes() {
        let json = FingerprintPolicy::new().json_body();
        let with = |content_type: &str, body: &str| {
            let request = parts(
                Request::post("/p")
                    .header("content-type", content_type)
                    .body(())
                    .unwrap(),
            );
            json.fingerprint(&request, body.as_bytes())
        };
        // A body re-spelt (spaces, order, numbers, escapes): `json_fingerprints_follow_the_meaning`.
        let ct = "application/json";
        assert_eq!(
            with("application/merge-patch+json; charset=utf-8", "[1]"),
            with("application/merge-patch+json; charset=utf-8", "[ 1 ]")
        );
        assert_ne!(with(ct, r#"{"amount":42}"#), with(ct, r#"{"amount":"42"}"#));
        assert_ne!(
            with(ct, r#"{"amount":42}"#),
            with(ct, r#"{"amount":42,"x":null}"#)
        );
        // Not JSON by its Content-Type, or not I-JSON: the bytes count, all of them.
        for (content_type, a, b) in [
            ("text/plain", r#"{"amount":42}"#, r#"{"amount": 42}"#),
            ("", r#"{"amount":42}"#, r#"{"amount": 42}"#),
            (ct, r#"{"amount":42"#, r#"{"amount": 42"#),
            (ct, r#"{"amount":1,"amount":2}"#, r#"{"amount": 1,"amount":2}"#),
            (
                ct,
                r#"{"amount":0.10000000000000000001}"#,
                r#"{"amount": 0.10000000000000000001}"#,
            ),
        ] {
            assert_ne!(with(content_type, a), with(content_type, b), "{content_type} {a}");
            assert_eq!(with(content_type, a), with(content_type, a));
        }
        // Duplicate members never read as either of the values they name.
        assert_ne!(
            with(ct, r#"{"amount":1,"amount":2}"#),
            with(ct, r#"{"amount":2}"#)
        );
        assert_ne!(
            with(ct, r#"{"amount":1,"amount":2}"#),
            with(ct, r#"{"amount":1}"#)
        );
        assert_ne!(
            with(ct, r#"{"amount":0.10000000000000000001}"#),
            with(ct, r#"{"amount":0.1}"#)
        );
    }

    /// A record made under one policy is a mismatch under another: the policy is in the
    /// fingerprint, so no two policies share one for any body.
    #[test]
    fn every_json_policy_fingerprints_apart() {
        let request = json_request();
        let pointer = |p: &str| JsonPointer::parse(p).unwrap();
        let body = br#"{"amount":42,"at":"now"}"#;
        let policies = [
            FingerprintPolicy::new(),
            FingerprintPolicy::new().media_type_only(),
            FingerprintPolicy::new().without_body(),
            FingerprintPolicy::new().json_body(),
            FingerprintPolicy::new().json_body_only([pointer("")]),
            FingerprintPolicy::new().json_body_only([pointer("/amount")]),
            FingerprintPolicy::new().json_body_only([pointer("/amount"), pointer("/at")]),
            FingerprintPolicy::new().json_body_except([pointer("/at")]),
            FingerprintPolicy::new().json_body_except([pointer("/a/t")]),
            FingerprintPolicy::new().json_body_except([pointer("/a~1t")]),
            FingerprintPolicy::new().json_body_except([]),
        ];
        let fingerprints: Vec<_> = policies.iter().map(|p| p.fingerprint(&request, body)).collect();
        // The default's and media_type_only's agree on a bare `application/json`, as before.
        for (i, a) in fingerprints.iter().enumerate().skip(2) {
            for (j, b) in fingerprints.iter().enumerate().skip(i + 1) {
                assert_ne!(a, b, "{:?} and {:?}", policies[i], policies[j]);
            }
            assert_ne!(*a, fingerprints[0], "{:?}", policies[i]);
        }
        // The order pointers are given in does not matter.
        assert_eq!(
            FingerprintPolicy::new().json_body_only([pointer("/at"), pointer("/amount"), pointer("/at")]),
            FingerprintPolicy::new().json_body_only([pointer("/amount"), pointer("/at")])
        );
        // An absent member is not a null one.
        let only = FingerprintPolicy::new().json_body_only([pointer("/x")]);
        assert_ne!(
            only.fingerprint(&request, b"{}"),
            only.fingerprint(&request, br#"{"x":null}"#)
        );
    }

    use proptest::prelude::*;

    /// A host name (labels of letters in any case, digits and `-`, maybe a trailing dot), or
    /// an IPv6 literal; and a port: none, 80, 443 or another.
    fn authorities() -> impl Strategy<Value = (String, Option<u16>)> {
        let host = prop_oneof![
            ("[a-cA-C0-9-]{1,3}(\\.[a-cA-C0-9-]{1,3}){0,2}", any::<bool>()).prop_map(|(h, dot)| if dot {
                format!("{h}.")
            } else {
                h
            }),
            "\\[(::1|2001:[dD][bB]8::[0-9a-fA-F]{1,2})\\]",
        ];
        let port = proptest::option::of(prop_oneof![Just(80u16), Just(443), Just(8080), 1u16..3]);
        (host, port)
    }

    fn written((host, port): &(String, Option<u16>)) -> String {
        match port {
            Some(port) => format!("{host}:{port}"),
            None => host.clone(),
        }
    }

    /// What DNS and HTTP take the authority for: the host lower-cased without its trailing
    /// dot, and the port, the defaults 80 and 443 being none (the layer cannot tell the scheme).
    fn named((host, port): &(String, Option<u16>)) -> (String, Option<u16>) {
        let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        (host, port.filter(|p| *p != 80 && *p != 443))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Two authorities normalise alike exactly when they name the same host and port: no
        /// two hosts share records (unscoped keys of `a.example` never replay for
        /// `b.example`), and no spelling of one host makes a retry a mismatch. Normalised twice
        /// is normalised once.
        #[test]
        fn authorities_normalise_alike_exactly_when_they_name_the_same_host(a in authorities(), b in authorities()) {
            let (x, y) = (written(&a), written(&b));
            let nx = normalized_authority(x.as_bytes()).into_owned();
            let ny = normalized_authority(y.as_bytes()).into_owned();
            prop_assert_eq!(nx == ny, named(&a) == named(&b), "{} {}", x, y);
            prop_assert_eq!(&*normalized_authority(&nx), &nx[..]);
            check(format!("{x}\n\n/").as_bytes());
        }

        /// The media type is the type and subtype, lower-cased, whatever the parameters and
        /// spaces; and `Content-Type` as sent counts in full by default.
        #[test]
        fn media_types_ignore_parameters_and_case(
            media in "[a-zA-Z]{1,5}/[a-zA-Z+.-]{1,8}",
            params in "( ?; ?[a-z]{1,6}=[A-Za-z0-9-]{1,6}){0,2}",
            space in " {0,2}",
        ) {
            let value = format!("{space}{media}{space}{params}");
            let lower = media.to_ascii_lowercase();
            prop_assert_eq!(&*media_type(value.as_bytes()), lower.as_bytes());
            let policy = FingerprintPolicy::new().media_type_only();
            let with = |ct: &str| {
                let request = parts(Request::post("/p").header("content-type", ct).body(()).unwrap());
                (policy.fingerprint(&request, b""), FingerprintPolicy::new().fingerprint(&request, b""))
            };
            let (loose, full) = with(&value);
            prop_assert_eq!(loose, with(&media.to_ascii_lowercase()).0);
            prop_assert_eq!(full == with(&media).1, value == media);
        }

        /// A request's fingerprint is the same in absolute form and in origin form with `Host`,
        /// whatever the case of the authority; a different method, path, query or body is
        /// another fingerprint.
        #[test]
        fn requests_naming_the_same_target_share_a_fingerprint(
            a in authorities(),
            path in "(/[a-z0-9%._~-]{0,6}){1,3}(\\?[a-z0-9=&]{0,8})?",
            other in "(/[a-z0-9%._~-]{0,6}){1,3}(\\?[a-z0-9=&]{0,8})?",
            body in proptest::collection::vec(any::<u8>(), 0..20),
        ) {
            let authority = written(&a);
            let policy = FingerprintPolicy::new();
            let absolute = parts(Request::post(format!("http://{}{path}", authority.to_ascii_uppercase())).body(()).unwrap());
            let origin = parts(Request::post(path.as_str()).header("host", authority.as_str()).body(()).unwrap());
            prop_assert_eq!(policy.fingerprint(&absolute, &body), policy.fingerprint(&origin, &body));
            let put = parts(Request::put(path.as_str()).header("host", authority.as_str()).body(()).unwrap());
            prop_assert_ne!(policy.fingerprint(&put, &body), policy.fingerprint(&origin, &body));
            let moved = parts(Request::post(other.as_str()).header("host", authority.as_str()).body(()).unwrap());
            prop_assert_eq!(policy.fingerprint(&moved, &body) == policy.fingerprint(&origin, &body), other == path);
            prop_assert_ne!(policy.fingerprint(&origin, &[&body[..], b"x"].concat()), policy.fingerprint(&origin, &body));
            check(format!("{authority}\napplication/json\nhttp://{authority}{path}").as_bytes());
        }

        /// Under `json_body`, any reordering, re-spacing or re-spelling of a body keeps its
        /// fingerprint; under `json_body_except`, so does any change to the members left out;
        /// and the fingerprint is never a bytes policy's.
        #[test]
        fn json_fingerprints_follow_the_meaning(
            value in crate::canonical_json::tests::values(),
            a in any::<u64>(),
            b in any::<u64>(),
            excluded in crate::canonical_json::tests::values(),
            replaced in crate::canonical_json::tests::values(),
        ) {
            let (mut a, mut b) = (a, b);
            let request = json_request();
            let json = FingerprintPolicy::new().json_body();
            let one = crate::canonical_json::tests::respelt(&value, &mut a);
            let other = crate::canonical_json::tests::respelt(&value, &mut b);
            prop_assert_eq!(json.fingerprint(&request, one.as_bytes()), json.fingerprint(&request, other.as_bytes()), "{} / {}", one, other);
            prop_assert_ne!(json.fingerprint(&request, one.as_bytes()), FingerprintPolicy::new().fingerprint(&request, one.as_bytes()));

            // One member left out: whatever it holds does not count; everything else does.
            let body = |sent_at: &serde_json::Value, seed: &mut u64| {
                let mut object = serde_json::Map::new();
                object.insert("payload".into(), value.clone());
                object.insert("sent_at".into(), sent_at.clone());
                crate::canonical_json::tests::respelt(&serde_json::Value::Object(object), seed)
            };
            let except = FingerprintPolicy::new().json_body_except([JsonPointer::parse("/sent_at").unwrap()]);
            let (x, y) = (body(&excluded, &mut a), body(&replaced, &mut b));
            prop_assert_eq!(except.fingerprint(&request, x.as_bytes()), except.fingerprint(&request, y.as_bytes()), "{} / {}", x, y);
            prop_assert_eq!(json.fingerprint(&request, x.as_bytes()) == json.fingerprint(&request, y.as_bytes()), same_json(&excluded, &replaced));
        }

        /// Under `json_body_only`, a change to a chosen value changes the fingerprint, and a
        /// change anywhere else never does.
        #[test]
        fn only_the_chosen_json_members_count(
            chosen in crate::canonical_json::tests::values(),
            changed in crate::canonical_json::tests::values(),
            rest in crate::canonical_json::tests::values(),
            other_rest in crate::canonical_json::tests::values(),
            seed in any::<u64>(),
        ) {
            let mut seed = seed;
            let request = json_request();
            let only = FingerprintPolicy::new().json_body_only([JsonPointer::parse("/order/amount").unwrap()]);
            let body = |amount: &serde_json::Value, rest: &serde_json::Value, seed: &mut u64| {
                let value = serde_json::json!({"order": {"amount": amount, "note": rest}, "rest": rest});
                crate::canonical_json::tests::respelt(&value, seed)
            };
            let first = only.fingerprint(&request, body(&chosen, &rest, &mut seed).as_bytes());
            prop_assert_eq!(first, only.fingerprint(&request, body(&chosen, &other_rest, &mut seed).as_bytes()));
            prop_assert_eq!(
                first == only.fingerprint(&request, body(&changed, &rest, &mut seed).as_bytes()),
                same_json(&chosen, &changed)
            );
        }

        /// Any bytes: the fuzz check.
        #[test]
        fn any_bytes_pass_the_fuzz_check(data in proptest::collection::vec(any::<u8>(), 0..80), text in "[ -~]{0,20}(\n[ -~]{0,20}){0,2}") {
            check(&data);
            check(text.as_bytes());
        }
    }
}
