//! What makes two HTTP requests the same request: [`FingerprintPolicy`], and the fingerprint the
//! layer computes from it.

use std::borrow::Cow;

use http::header::{HeaderName, CONTENT_TYPE, HOST};
use http::request;

use crate::fingerprint::{Fingerprint, FingerprintBuilder};

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
/// Changing an endpoint's policy changes the fingerprint of requests that differ in the parts
/// changed: a retry across that deploy may then be answered as a mismatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FingerprintPolicy {
    pub(crate) content_type: ContentTypePart,
    pub(crate) headers: Vec<HeaderName>,
    pub(crate) body: bool,
}

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
        Self {
            content_type: ContentTypePart::Full,
            headers: Vec::new(),
            body: true,
        }
    }
}

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
    pub fn media_type_only(mut self) -> Self {
        self.content_type = ContentTypePart::MediaType;
        self
    }

    /// `Content-Type` does not count at all.
    ///
    /// ```
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().without_content_type();
    /// # let _ = policy;
    /// ```
    pub fn without_content_type(mut self) -> Self {
        self.content_type = ContentTypePart::Ignored;
        self
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
    pub fn with_header(mut self, name: HeaderName) -> Self {
        if !self.headers.contains(&name) {
            self.headers.push(name);
        }
        self
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
    pub fn without_body(mut self) -> Self {
        self.body = false;
        self
    }

    /// The fingerprint of a request with this policy. The default policy's parts are exactly
    /// those of earlier releases, in the same order; the options only change a part's bytes
    /// (`Content-Type`, body) or add parts after them (headers).
    pub(crate) fn fingerprint(&self, parts: &request::Parts, body: &[u8]) -> Fingerprint {
        let authority = match parts.uri.authority() {
            Some(authority) => authority.as_str().as_bytes(),
            None => parts.headers.get(HOST).map_or(&[][..], |v| v.as_bytes()),
        };
        let authority = normalized_authority(authority);
        let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let content_type = parts.headers.get(CONTENT_TYPE).map_or(&[][..], |v| v.as_bytes());
        let mut fingerprint = FingerprintBuilder::default();
        fingerprint.part(parts.method.as_str().as_bytes());
        fingerprint.part(&authority);
        fingerprint.part(path_and_query.as_bytes());
        match self.content_type {
            ContentTypePart::Full => fingerprint.part(content_type),
            ContentTypePart::MediaType => fingerprint.part(&media_type(content_type)),
            ContentTypePart::Ignored => fingerprint.part(&[]),
        }
        fingerprint.part(if self.body { body } else { &[] });
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
        fingerprint.finish()
    }
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

    #[test]
    fn media_type_only_ignores_parameters_and_case() {
        assert_eq!(
            &*media_type(b"Application/JSON; charset=utf-8"),
            b"application/json"
        );
        assert_eq!(&*media_type(b" text/plain ;q=1"), b"text/plain");
        assert!(matches!(media_type(b"application/json"), Cow::Borrowed(_)));
        let policy = FingerprintPolicy::new().media_type_only();
        let with = |ct: &str| {
            let request = parts(Request::post("/p").header("content-type", ct).body(()).unwrap());
            policy.fingerprint(&request, b"{}")
        };
        assert_eq!(with("application/json"), with("application/JSON; charset=utf-8"));
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
}
