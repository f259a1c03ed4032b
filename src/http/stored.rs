//! The stored form of a response, and replaying it byte for byte.

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, StatusCode};

use crate::reconciliation::NotStored;

/// Every stored payload starts with these three bytes and a layout version.
const MAGIC: &[u8; 3] = b"TIR";

/// The layout this release writes. Version 1 (a response without trailers) is still read, so
/// records written by the release before this one replay during a rolling upgrade; a version
/// above this one was written by a newer release and is answered like a request in flight.
pub(crate) const PAYLOAD_VERSION: u8 = 2;

/// The kind byte of a version 2 payload.
const RESPONSE: u8 = b'R';
const NOT_STORED: u8 = b'N';

impl NotStored {
    fn code(self) -> u8 {
        match self {
            NotStored::TooLarge => b'L',
            NotStored::BodyFailed => b'F',
            NotStored::TimedOut => b'T',
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            b'L' => Some(NotStored::TooLarge),
            b'F' => Some(NotStored::BodyFailed),
            b'T' => Some(NotStored::TimedOut),
            _ => None,
        }
    }
}

/// A stored response written as it streams, in the version 2 layout:
///
/// ```text
/// "TIR" 2 'R' | status u16 | count u32 | (name_len u32, name, value_len u32, value)*
///   | body_len u64 | body | trailer count u32 | (name_len u32, name, value_len u32, value)*
/// ```
///
/// Head and body go into one buffer, sized up front when the body's size is known; the body's
/// length is filled in once it has ended, so a body of unknown length is copied once, as it
/// passes, and never held twice.
pub(crate) struct StoredResponse {
    out: BytesMut,
    body_len_at: usize,
    limit: usize,
}

impl StoredResponse {
    /// Starts a payload for `status` and the `headers` that `keep` accepts, for a body of about
    /// `expected_body` bytes and at most `limit`.
    pub(crate) fn start(
        status: StatusCode,
        headers: &HeaderMap,
        keep: impl Fn(&HeaderName) -> bool,
        expected_body: usize,
        limit: usize,
    ) -> Self {
        let kept = || headers.iter().filter(|(name, _)| keep(name));
        // Sized and counted in one pass over the headers, written in a second.
        let (size, count) = kept().fold((0, 0), |(size, count), (n, v)| {
            (size + 8 + n.as_str().len() + v.len(), count + 1)
        });
        let mut out = BytesMut::with_capacity(MAGIC.len() + 2 + 6 + size + 8 + expected_body.min(limit) + 4);
        out.put_slice(MAGIC);
        out.put_u8(PAYLOAD_VERSION);
        out.put_u8(RESPONSE);
        out.put_u16(status.as_u16());
        put_fields(&mut out, count, kept());
        let body_len_at = out.len();
        out.put_u64(0);
        Self {
            out,
            body_len_at,
            limit,
        }
    }

    /// Appends a piece of the body; `false` (and nothing appended) if it would go over the limit.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> bool {
        if self.body_len() + chunk.len() > self.limit {
            return false;
        }
        self.out.extend_from_slice(chunk);
        true
    }

    fn body_len(&self) -> usize {
        self.out.len() - self.body_len_at - 8
    }

    /// The payload, and where the body sits in it (so the client can be sent a slice of the
    /// stored copy rather than a second one).
    pub(crate) fn finish(mut self, trailers: Option<&HeaderMap>) -> (Bytes, std::ops::Range<usize>) {
        let body_len = self.body_len();
        let body_at = self.body_len_at + 8;
        self.out[self.body_len_at..body_at].copy_from_slice(&(body_len as u64).to_be_bytes());
        match trailers {
            Some(trailers) => put_fields(&mut self.out, trailers.len(), trailers.iter()),
            None => self.out.put_u32(0),
        }
        (self.out.freeze(), body_at..body_at + body_len)
    }
}

fn put_fields<'a>(
    out: &mut BytesMut,
    count: usize,
    fields: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) {
    out.put_u32(count as u32);
    for (name, value) in fields {
        out.put_u32(name.as_str().len() as u32);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
}

/// Encodes a whole response (status, the headers `keep` accepts, all values in order as raw
/// bytes, the body and any trailers) in one go.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    keep: impl Fn(&HeaderName) -> bool,
    body: &[u8],
    trailers: Option<&HeaderMap>,
) -> Bytes {
    let mut stored = StoredResponse::start(status, headers, keep, body.len(), usize::MAX);
    stored.push(body);
    stored.finish(trailers).0
}

/// The record of a request that ran but whose response was not stored: why, and the status
/// the client was sent, if it got that far.
pub(crate) fn encode_not_stored(why: NotStored, status: Option<StatusCode>) -> Bytes {
    let mut out = BytesMut::with_capacity(MAGIC.len() + 1 + 1 + 1 + 2);
    out.put_slice(MAGIC);
    out.put_u8(PAYLOAD_VERSION);
    out.put_u8(NOT_STORED);
    out.put_u8(why.code());
    out.put_u16(status.map_or(0, |s| s.as_u16()));
    out.freeze()
}

/// A decoded stored response.
#[derive(Debug)]
pub(crate) struct Stored {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

/// What a stored payload holds.
// Decoded once per replay and moved once; boxing the response would cost an allocation each time.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Decoded {
    /// A response to replay.
    Response(Stored),
    /// The request ran; its response was not stored.
    NotStored {
        why: NotStored,
        status: Option<StatusCode>,
    },
    /// Written by a newer release in a layout this one does not know.
    Newer { version: u8 },
}

impl Decoded {
    /// The status of the stored response, or the one the first client was sent.
    pub(crate) fn status(&self) -> Option<StatusCode> {
        match self {
            Decoded::Response(stored) => Some(stored.status),
            Decoded::NotStored { status, .. } => *status,
            Decoded::Newer { .. } => None,
        }
    }
}

/// Decodes what this release or the one before wrote; anything else is refused with a reason.
pub(crate) fn decode(payload: &Bytes) -> Result<Decoded, String> {
    let mut reader = Reader { payload, at: 0 };
    if reader.take(MAGIC.len()).ok() != Some(&MAGIC[..]) {
        return Err("not a stored response (unknown layout)".into());
    }
    let version = reader.array::<1>()?[0];
    let kind = match version {
        // Version 1 held a response only: status, headers, and the rest is the body; no trailers.
        1 => RESPONSE,
        PAYLOAD_VERSION => reader.array::<1>()?[0],
        0 => return Err("not a stored response (layout version 0)".into()),
        newer => return Ok(Decoded::Newer { version: newer }),
    };
    match kind {
        RESPONSE => {
            let status = stored_status(u16::from_be_bytes(reader.array()?))?;
            let headers = read_fields(&mut reader)?;
            let (body, trailers) = if version == 1 {
                (payload.slice(reader.at..), None)
            } else {
                let body_len = u64::from_be_bytes(reader.array()?);
                let body_len =
                    usize::try_from(body_len).map_err(|_| "stored body length exceeds the record")?;
                let body = reader.take_shared(body_len)?;
                let trailers = read_fields(&mut reader)?;
                if reader.at != payload.len() {
                    return Err("bytes after the stored response".into());
                }
                (body, (!trailers.is_empty()).then_some(trailers))
            };
            Ok(Decoded::Response(Stored {
                status,
                headers,
                body,
                trailers,
            }))
        }
        NOT_STORED => {
            let why = NotStored::from_code(reader.array::<1>()?[0])
                .ok_or("unknown reason for an unstored response")?;
            // 0: the client was sent no status.
            let code = u16::from_be_bytes(reader.array()?);
            let status = (code != 0).then(|| stored_status(code)).transpose()?;
            if reader.at != payload.len() {
                return Err("bytes after an unstored response".into());
            }
            Ok(Decoded::NotStored { why, status })
        }
        _ => Err("unknown kind of stored payload".into()),
    }
}

fn stored_status(code: u16) -> Result<StatusCode, String> {
    StatusCode::from_u16(code).map_err(|_| format!("invalid stored status {code}"))
}

fn read_fields(reader: &mut Reader<'_>) -> Result<HeaderMap, String> {
    let count = u32::from_be_bytes(reader.array()?);
    // Each field takes at least 9 bytes; a count the payload cannot hold is garbage.
    if count as usize > reader.payload.len() / 9 {
        return Err("stored header count exceeds the record".into());
    }
    // Not sized from `count`: the replay adds `Idempotent-Replayed` after, which a map sized to
    // the stored fields would have to grow for (and a corrupt count must size nothing).
    let mut fields = HeaderMap::new();
    for _ in 0..count {
        let len = u32::from_be_bytes(reader.array()?) as usize;
        let name = HeaderName::from_bytes(reader.take(len)?).map_err(|_| "invalid stored header name")?;
        let len = u32::from_be_bytes(reader.array()?) as usize;
        // A view of the record, not a copy: the replayed body is one too, so the record stays
        // in memory until the response is sent either way.
        let value = HeaderValue::from_maybe_shared(reader.take_shared(len)?)
            .map_err(|_| "invalid stored header value")?;
        fields
            .try_append(name, value)
            .map_err(|_| "too many stored headers")?;
    }
    Ok(fields)
}

struct Reader<'a> {
    payload: &'a Bytes,
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, len: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(len).filter(|end| *end <= self.payload.len());
        let end = end.ok_or("stored response is truncated")?;
        let slice = &self.payload[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn take_shared(&mut self, len: usize) -> Result<Bytes, String> {
        let start = self.at;
        self.take(len)?;
        Ok(self.payload.slice(start..self.at))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
}

/// The fuzz target's check of one input as a stored response (`fuzz/fuzz_targets/`, and
/// `tests/fuzz_corpora.rs` on every checked-in input): decoding never panics; what decodes
/// encodes back to as many bytes (nothing in the payload is skipped or read twice) and to the
/// same response; an unstored response's record is exactly its 8 bytes; a payload of this
/// layout cut short never decodes, and one of version 1 (no body length) only with its body
/// cut.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) {
    let payload = Bytes::copy_from_slice(data);
    let Ok(decoded) = decode(&payload) else {
        return;
    };
    let version = data[3];
    match &decoded {
        Decoded::Response(stored) => {
            let again = encode(
                stored.status,
                &stored.headers,
                |_| true,
                &stored.body,
                stored.trailers.as_ref(),
            );
            if version == PAYLOAD_VERSION {
                assert_eq!(again.len(), data.len(), "bytes skipped or read twice");
            }
            let Ok(Decoded::Response(twice)) = decode(&again) else {
                panic!("a re-encoded response does not decode");
            };
            assert_eq!(
                (twice.status, &twice.headers, &twice.body, &twice.trailers),
                (stored.status, &stored.headers, &stored.body, &stored.trailers)
            );
        }
        Decoded::NotStored { why, status } => {
            assert_eq!(
                encode_not_stored(*why, *status),
                data,
                "an unstored record is 8 bytes"
            );
        }
        Decoded::Newer { version: newer } => {
            assert!(*newer > PAYLOAD_VERSION && *newer == version);
            return;
        }
    }
    for cut in 0..data.len() {
        match (decode(&payload.slice(..cut)), &decoded) {
            (Err(_), _) => {}
            (Ok(Decoded::Response(shorter)), Decoded::Response(whole)) if version == 1 => {
                assert_eq!((shorter.status, &shorter.headers), (whole.status, &whole.headers));
                assert!(whole.body.starts_with(&shorter.body));
            }
            (Ok(shorter), _) => panic!("cut at {cut} of {}, decoded as {shorter:?}", data.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(payload: &Bytes) -> Stored {
        match decode(payload) {
            Ok(Decoded::Response(stored)) => stored,
            other => panic!("not a stored response: {other:?}"),
        }
    }

    #[test]
    fn a_body_written_as_it_streams_stops_at_the_limit() {
        let mut stored = StoredResponse::start(StatusCode::OK, &HeaderMap::new(), |_| true, 0, 10);
        assert!(stored.push(b"hello"));
        assert!(stored.push(b"world"));
        assert!(!stored.push(b"!"), "over the limit");
        let (payload, body) = stored.finish(None);
        assert_eq!(&payload[body.clone()], b"helloworld");
        assert_eq!(response(&payload).body, payload.slice(body));
    }

    /// A payload exactly as the release before this one wrote it (layout version 1): status 201,
    /// `x-old: 1`, body `old`. Kept byte for byte so that release's records always replay.
    const VERSION_1: &[u8] = b"TIR\x01\x00\xc9\x00\x00\x00\x01\x00\x00\x00\x05x-old\x00\x00\x00\x011old";

    #[test]
    fn reads_the_previous_layout() {
        let stored = response(&Bytes::from_static(VERSION_1));
        assert_eq!(stored.status, StatusCode::CREATED);
        assert_eq!(stored.headers.get("x-old").unwrap(), "1");
        assert_eq!(&stored.body[..], b"old");
        assert!(stored.trailers.is_none());
    }

    // A newer layout, and why a response was not stored: the properties `other_versions_and_kinds`
    // and `unstored_responses_round_trip`, below.

    #[test]
    fn refuses_garbage_and_truncation() {
        assert!(decode(&Bytes::from_static(b"garbage")).is_err());
        assert!(decode(&Bytes::new()).is_err());
        assert!(decode(&Bytes::from_static(b"TIR\x00")).is_err());
        let trailers = HeaderMap::from_iter([(http::header::EXPIRES, HeaderValue::from_static("0"))]);
        let payload = encode(
            StatusCode::OK,
            &HeaderMap::from_iter([(http::header::ETAG, HeaderValue::from_static("x"))]),
            |_| true,
            b"body",
            Some(&trailers),
        );
        for cut in 0..payload.len() {
            assert!(decode(&payload.slice(..cut)).is_err(), "cut at {cut}");
        }
        for cut in 0..VERSION_1.len() - 3 {
            assert!(
                decode(&Bytes::from_static(&VERSION_1[..cut])).is_err(),
                "v1 cut at {cut}"
            );
        }
        let not_stored = encode_not_stored(NotStored::TimedOut, None);
        for cut in 0..not_stored.len() {
            assert!(decode(&not_stored.slice(..cut)).is_err(), "cut at {cut}");
        }
        // Bytes after an unstored response: `unstored_responses_round_trip`.
        let mut extra = payload.to_vec();
        extra.push(0);
        assert!(decode(&Bytes::from(extra)).is_err(), "trailing bytes");
        let mut too_many = payload.to_vec();
        too_many[7..11].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&Bytes::from(too_many)).is_err());
        let mut long_body = payload.to_vec();
        let body_len_at = 11 + 8 + 4 + 1;
        long_body[body_len_at..body_len_at + 8].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(decode(&Bytes::from(long_body)).is_err());
        // More distinct names than a HeaderMap holds is refused, not a panic.
        let names = 40_000u32;
        let mut many = BytesMut::from(&b"TIR\x02R"[..]);
        many.put_u16(200);
        many.put_u32(names);
        for i in 0..names {
            let name = format!("x-{i}");
            many.put_u32(name.len() as u32);
            many.put_slice(name.as_bytes());
            many.put_u32(1);
            many.put_slice(b"v");
        }
        assert!(decode(&many.freeze()).is_err());
        let mut bad_status = payload.to_vec();
        bad_status[5..7].copy_from_slice(&42u16.to_be_bytes());
        assert!(decode(&Bytes::from(bad_status)).is_err());
        let mut bad_kind = payload.to_vec();
        bad_kind[4] = b'?';
        assert!(decode(&Bytes::from(bad_kind)).is_err());
    }

    /// Today's stored-response layout (version 2), byte for byte: a response (201, two
    /// `x-multi` values and a Latin-1 one, a body with a NUL, a `grpc-status` trailer), and an
    /// unstored one. The next release must read these; a change of the layout fails here.
    const RESPONSE_V2: &[u8] = b"TIR\x02R\x00\xc9\x00\x00\x00\x03\
        \x00\x00\x00\x07x-multi\x00\x00\x00\x03one\
        \x00\x00\x00\x07x-multi\x00\x00\x00\x03two\
        \x00\x00\x00\x08x-latin1\x00\x00\x00\x04caf\xe9\
        \x00\x00\x00\x00\x00\x00\x00\x03a\x00b\
        \x00\x00\x00\x01\x00\x00\x00\x0bgrpc-status\x00\x00\x00\x010";
    const NOT_STORED_V2: &[u8] = b"TIR\x02NL\x00\xc8";

    #[test]
    fn todays_stored_responses_are_pinned_byte_for_byte() {
        let stored = response(&Bytes::from_static(RESPONSE_V2));
        assert_eq!(stored.status, StatusCode::CREATED);
        let multi: Vec<_> = stored.headers.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["one", "two"]);
        assert_eq!(stored.headers["x-latin1"].as_bytes(), b"caf\xe9");
        assert_eq!(stored.headers.len(), 3);
        assert_eq!(&stored.body[..], b"a\x00b");
        let trailers = stored.trailers.as_ref().expect("trailers");
        assert_eq!(
            (trailers.len(), &trailers["grpc-status"]),
            (1, &HeaderValue::from_static("0"))
        );
        let again = encode(
            stored.status,
            &stored.headers,
            |_| true,
            &stored.body,
            stored.trailers.as_ref(),
        );
        assert_eq!(&again[..], RESPONSE_V2);
        // Without trailers too: the same response, its trailers none.
        let untrailed = response(&encode(
            stored.status,
            &stored.headers,
            |_| true,
            &stored.body,
            None,
        ));
        assert_eq!(
            (untrailed.headers, untrailed.body, untrailed.trailers),
            (stored.headers, stored.body, None)
        );

        let decoded = decode(&Bytes::from_static(NOT_STORED_V2)).unwrap();
        assert!(matches!(
            decoded,
            Decoded::NotStored {
                why: NotStored::TooLarge,
                status: Some(StatusCode::OK)
            }
        ));
        assert_eq!(
            &encode_not_stored(NotStored::TooLarge, Some(StatusCode::OK))[..],
            NOT_STORED_V2
        );
        check(RESPONSE_V2);
        check(NOT_STORED_V2);
        check(VERSION_1);
    }

    use proptest::prelude::*;

    fn header_maps() -> impl Strategy<Value = HeaderMap> {
        let name = "[a-zA-Z][a-zA-Z0-9-]{0,12}".prop_map(|n| HeaderName::from_bytes(n.as_bytes()).unwrap());
        let value = proptest::collection::vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, Just(b'\t')], 0..20)
            .prop_map(|v| HeaderValue::from_bytes(&v).unwrap());
        proptest::collection::vec((name, value), 0..8).prop_map(|fields| {
            let mut map = HeaderMap::new();
            for (name, value) in fields {
                map.append(name, value);
            }
            map
        })
    }

    fn statuses() -> impl Strategy<Value = StatusCode> {
        (100u16..1000).prop_map(|s| StatusCode::from_u16(s).unwrap())
    }

    fn reasons() -> impl Strategy<Value = NotStored> {
        prop_oneof![
            Just(NotStored::TooLarge),
            Just(NotStored::BodyFailed),
            Just(NotStored::TimedOut)
        ]
    }

    proptest! {
        // 128 cases each: the fuzz check decodes every cut of each payload (the whole set of
        // property tests stays near 2 s in a debug build).
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Any response round trips: status, every header value in order as raw bytes, the
        /// body, the trailers; encoding what was decoded gives the same bytes; and every cut
        /// of it is an error (the fuzz check).
        #[test]
        fn responses_round_trip_exactly(
            status in statuses(),
            headers in header_maps(),
            body in proptest::collection::vec(any::<u8>(), 0..100),
            trailers in proptest::option::of(header_maps()),
        ) {
            let trailers = trailers.filter(|t| !t.is_empty());
            let payload = encode(status, &headers, |_| true, &body, trailers.as_ref());
            let stored = response(&payload);
            prop_assert_eq!(stored.status, status);
            prop_assert_eq!(&stored.headers, &headers);
            prop_assert_eq!(&stored.body[..], &body[..]);
            prop_assert_eq!(&stored.trailers, &trailers);
            let again = encode(stored.status, &stored.headers, |_| true, &stored.body, stored.trailers.as_ref());
            prop_assert_eq!(&again, &payload);
            check(&payload);
        }

        /// A body written in pieces, as it streams, is the same payload as written at once.
        #[test]
        fn a_streamed_body_is_stored_as_one(
            headers in header_maps(),
            pieces in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..6),
        ) {
            let whole = pieces.concat();
            let mut stored = StoredResponse::start(StatusCode::OK, &headers, |_| true, 0, usize::MAX);
            for piece in &pieces {
                prop_assert!(stored.push(piece));
            }
            let (payload, body) = stored.finish(None);
            prop_assert_eq!(&payload[body], &whole[..]);
            prop_assert_eq!(payload, encode(StatusCode::OK, &headers, |_| true, &whole, None));
        }

        /// Unstored responses round trip to exactly their 8 bytes, and nothing else decodes
        /// as one.
        #[test]
        fn unstored_responses_round_trip(why in reasons(), status in proptest::option::of(statuses()), extra in proptest::collection::vec(any::<u8>(), 1..4)) {
            let payload = encode_not_stored(why, status);
            let decoded = decode(&payload).unwrap();
            let same = matches!(decoded, Decoded::NotStored { why: w, status: s } if w == why && s == status);
            prop_assert!(same);
            prop_assert_eq!(payload.len(), 8);
            let longer = Bytes::from([&payload[..], &extra].concat());
            prop_assert!(decode(&longer).is_err(), "bytes after an unstored response");
            check(&payload);
        }

        /// A version above this one is another release's (never corrupt, never replayed as
        /// ours); 0 and unknown kinds are errors.
        #[test]
        fn other_versions_and_kinds(version in any::<u8>(), kind in any::<u8>(), rest in proptest::collection::vec(any::<u8>(), 0..40)) {
            let payload = Bytes::from([&MAGIC[..], &[version, kind], &rest].concat());
            let decoded = decode(&payload);
            if version > PAYLOAD_VERSION {
                let newer = matches!(decoded, Ok(Decoded::Newer { version: v }) if v == version);
                prop_assert!(newer);
            } else if version == 0 || (version == PAYLOAD_VERSION && kind != RESPONSE && kind != NOT_STORED) {
                prop_assert!(decoded.is_err());
            }
            check(&payload);
        }

        /// A bit flipped anywhere decodes to an error, another release's layout, or exactly
        /// what its bytes say (the fuzz check); a flip in the magic, version or kind is never
        /// read as a response of this layout.
        #[test]
        fn bit_flips_are_errors_or_read_exactly(flip in any::<prop::sample::Index>(), bit in 0..8u8) {
            let mut payload = RESPONSE_V2.to_vec();
            let at = flip.index(payload.len());
            payload[at] ^= 1 << bit;
            if at < 5 {
                prop_assert!(!matches!(decode(&Bytes::from(payload.clone())), Ok(Decoded::Response(_))) || payload[3] == 1);
            }
            check(&payload);
        }

        /// Any bytes, and any bytes after a valid start: the fuzz check.
        #[test]
        fn any_bytes_pass_the_fuzz_check(data in proptest::collection::vec(any::<u8>(), 0..200), start in 0..=5usize) {
            check(&data);
            check(&[&RESPONSE_V2[..start], &data].concat());
        }
    }
}
