//! The stored form of a response, and replaying it byte for byte.

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Response, StatusCode};

use crate::body::ResponseBody;

/// Marks the stored layout, so bytes that are not a stored response are never replayed.
const MAGIC: &[u8; 4] = b"TIR\x01";

/// The header added to every replayed response, as Stripe does.
///
/// ```
/// assert_eq!(tower_idempotency::IDEMPOTENT_REPLAYED.as_str(), "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Encodes status, headers (all values, in order, as raw bytes) and body:
/// `MAGIC | status u16 | count u32 | (name_len u32, name, value_len u32, value)* | body`.
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    keep: impl Fn(&HeaderName) -> bool,
    body: &[u8],
) -> Bytes {
    let kept: Vec<_> = headers.iter().filter(|(name, _)| keep(name)).collect();
    let size = kept
        .iter()
        .map(|(n, v)| 8 + n.as_str().len() + v.len())
        .sum::<usize>();
    let mut out = BytesMut::with_capacity(MAGIC.len() + 6 + size + body.len());
    out.put_slice(MAGIC);
    out.put_u16(status.as_u16());
    out.put_u32(kept.len() as u32);
    for (name, value) in kept {
        out.put_u32(name.as_str().len() as u32);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
    out.put_slice(body);
    out.freeze()
}

/// A decoded stored response.
#[derive(Debug)]
pub(crate) struct Stored {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// Decodes what [`encode`] wrote; anything else is refused with a reason.
pub(crate) fn decode(payload: &Bytes) -> Result<Stored, String> {
    let mut reader = Reader { payload, at: 0 };
    if reader.take(MAGIC.len())? != MAGIC {
        return Err("not a stored response (unknown layout)".into());
    }
    let status = u16::from_be_bytes(reader.array()?);
    let status = StatusCode::from_u16(status).map_err(|_| format!("invalid stored status {status}"))?;
    let count = u32::from_be_bytes(reader.array()?);
    // Each header takes at least 9 bytes; a count the payload cannot hold is garbage.
    if count as usize > payload.len() / 9 {
        return Err("stored header count exceeds the record".into());
    }
    let mut headers = HeaderMap::new();
    for _ in 0..count {
        let len = u32::from_be_bytes(reader.array()?) as usize;
        let name = HeaderName::from_bytes(reader.take(len)?).map_err(|_| "invalid stored header name")?;
        let len = u32::from_be_bytes(reader.array()?) as usize;
        let value = HeaderValue::from_bytes(reader.take(len)?).map_err(|_| "invalid stored header value")?;
        headers
            .try_append(name, value)
            .map_err(|_| "too many stored headers")?;
    }
    Ok(Stored {
        status,
        headers,
        body: payload.slice(reader.at..),
    })
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

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
}

/// The response a retry gets: the stored one, plus `Idempotent-Replayed: true`.
pub(crate) fn into_response<B>(stored: Stored) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::full(stored.body));
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_repeated_and_non_utf8_headers_and_any_body() {
        let mut headers = HeaderMap::new();
        headers.append("x-multi", HeaderValue::from_static("one"));
        headers.append("x-multi", HeaderValue::from_static("two"));
        headers.append("x-latin1", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        headers.append(
            "content-type",
            HeaderValue::from_static("text/plain; charset=ISO-8859-1"),
        );
        let body = [0u8, 159, 146, 150, 255, b'\r', b'\n'];
        let payload = encode(StatusCode::CREATED, &headers, |_| true, &body);
        let stored = decode(&payload).unwrap();
        assert_eq!(stored.status, StatusCode::CREATED);
        assert_eq!(stored.headers, headers);
        let multi: Vec<_> = stored.headers.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["one", "two"]);
        assert_eq!(&stored.body[..], &body);
    }

    #[test]
    fn refuses_garbage_and_truncation() {
        assert!(decode(&Bytes::from_static(b"garbage")).is_err());
        assert!(decode(&Bytes::new()).is_err());
        let payload = encode(
            StatusCode::OK,
            &HeaderMap::from_iter([(http::header::ETAG, HeaderValue::from_static("x"))]),
            |_| true,
            b"",
        );
        for cut in 0..payload.len() {
            assert!(decode(&payload.slice(..cut)).is_err(), "cut at {cut}");
        }
        let mut too_many = payload.to_vec();
        too_many[6..10].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&Bytes::from(too_many)).is_err());
        // More distinct names than a HeaderMap holds is refused, not a panic.
        let names = 40_000u32;
        let mut many = BytesMut::from(&MAGIC[..]);
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
        bad_status[4..6].copy_from_slice(&42u16.to_be_bytes());
        assert!(decode(&Bytes::from(bad_status)).is_err());
    }
}
