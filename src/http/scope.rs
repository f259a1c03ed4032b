//! [`Scope`]: the scope functions most services need, for
//! [`IdempotencyLayer::with_scope`](crate::IdempotencyLayer::with_scope) and the policy file.

use http::header::{HeaderName, HOST};
use http::request;

use crate::http::fingerprint::normalized_authority;

/// Builds the common scope functions, for
/// [`IdempotencyLayer::with_scope`](crate::IdempotencyLayer::with_scope): each answers the
/// request's scope, or `None` when the request has none, which the layer refuses (500
/// [`Rejection::MissingScope`](crate::Rejection::MissingScope)) rather than run unscoped.
///
/// A replay is answered before the handler runs, so before any authentication the handler does:
/// the scope is what keeps one caller from getting another's stored response by sending the same
/// key and body. Only [`Scope::extension`], fed by the authentication layer outside this one,
/// scopes by who is calling; [`Scope::header`] and [`Scope::host`] scope by what the client
/// sent, which any client can reproduce.
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};
///
/// /// Put in the request's extensions by the authentication middleware.
/// #[derive(Clone)]
/// struct TenantId(String);
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .with_scope(Scope::extension::<TenantId>(|tenant| tenant.0.clone()));
/// # let _ = layer;
/// ```
#[derive(Debug)]
pub enum Scope {}

impl Scope {
    /// The scope is derived from a value of type `T` in the request's extensions, as an
    /// authentication middleware leaves it (a tenant, a user, an API client). A request without
    /// one has no scope: place the idempotency layer inside (after) the one that authenticates.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};
    /// #[derive(Clone)]
    /// struct User { id: u64 }
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_scope(Scope::extension::<User>(|user| user.id.to_string()));
    /// # let _ = layer;
    /// ```
    pub fn extension<T: Send + Sync + 'static>(
        scope: impl Fn(&T) -> String + Send + Sync + 'static,
    ) -> impl Fn(&request::Parts) -> Option<String> + Send + Sync + 'static {
        move |parts| parts.extensions.get::<T>().map(&scope)
    }

    /// The scope is the value of a request header, such as `X-Tenant-Id` set by an API gateway.
    /// Only for a header that something you trust sets, and removes from what clients send: a
    /// client that can set it can choose its scope, and replay another tenant's responses (a
    /// replay is answered before the handler authenticates).
    /// A request without the header, with it twice, or with a value that is not UTF-8 has no
    /// scope.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name (upper case is accepted), as the layer is
    /// configured.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(Scope::header("x-tenant-id"));
    /// # let _ = layer;
    /// ```
    pub fn header(name: &str) -> impl Fn(&request::Parts) -> Option<String> + Send + Sync + 'static {
        let Ok(header) = HeaderName::from_bytes(name.as_bytes()) else {
            panic!("Scope::header: {name:?} is not a valid header name");
        };
        header_scope(header)
    }

    /// The scope is the host the request was sent to (the URI's authority, else `Host`),
    /// normalised as for the fingerprint: lower case, without a trailing dot, without the
    /// default ports `:80` and `:443`; another port is kept. For services that tell tenants
    /// apart by host name (`acme.example.com`). A request without a host has no scope.
    ///
    /// The host is what the client sent, not who it is: any client can send `Host:
    /// acme.example.com`, and one that reproduces a caller's key and body under that host gets
    /// the caller's stored response, since a replay is answered before the handler
    /// authenticates. Only for hosts whose callers may see each other's responses, or behind
    /// something that checks each caller's right to the host before this layer; otherwise scope
    /// by the authenticated caller ([`Scope::extension`]).
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(Scope::host());
    /// # let _ = layer;
    /// ```
    pub fn host() -> impl Fn(&request::Parts) -> Option<String> + Send + Sync + 'static {
        host_scope
    }
}

pub(crate) fn header_scope(
    name: HeaderName,
) -> impl Fn(&request::Parts) -> Option<String> + Send + Sync + 'static {
    move |parts| {
        let mut values = parts.headers.get_all(&name).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => std::str::from_utf8(value.as_bytes()).ok().map(str::to_owned),
            // Two values name no one tenant: refuse rather than pick one.
            _ => None,
        }
    }
}

fn host_scope(parts: &request::Parts) -> Option<String> {
    let raw = match parts.uri.authority() {
        Some(authority) => authority.as_str().as_bytes(),
        None => parts.headers.get(HOST)?.as_bytes(),
    };
    if raw.is_empty() {
        return None;
    }
    let host = normalized_authority(raw);
    std::str::from_utf8(&host).ok().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(request: http::request::Builder) -> request::Parts {
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn host_scope_is_the_normalised_host() {
        let host = Scope::host();
        assert_eq!(
            host(&parts(
                Request::post("/p").header("host", "Acme.Example.com.:443")
            ))
            .as_deref(),
            Some("acme.example.com")
        );
        assert_eq!(
            host(&parts(Request::post("http://ACME.example.com:8080/p"))).as_deref(),
            Some("acme.example.com:8080")
        );
        assert_eq!(host(&parts(Request::post("/p"))), None);
    }

    #[test]
    fn header_scope_needs_exactly_one_utf8_value() {
        let tenant = Scope::header("X-Tenant-Id");
        assert_eq!(
            tenant(&parts(Request::post("/p").header("x-tenant-id", "t1"))).as_deref(),
            Some("t1")
        );
        assert_eq!(tenant(&parts(Request::post("/p"))), None);
        assert_eq!(
            tenant(&parts(
                Request::post("/p")
                    .header("x-tenant-id", "a")
                    .header("x-tenant-id", "b")
            )),
            None
        );
        let latin1 = http::HeaderValue::from_bytes(b"caf\xe9").unwrap();
        assert_eq!(
            tenant(&parts(Request::post("/p").header("x-tenant-id", latin1))),
            None
        );
    }
}
