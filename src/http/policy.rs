//! [`Policy`]: the layer's settings and its endpoints, loaded from a YAML, TOML or JSON file, and
//! turned into a [`PolicyLayer`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use crate::canonical_json::JsonPointer;
use crate::http::config::{handler_timeout_error, rejection_status_error};
use crate::http::endpoints::{PathPattern, PolicyError, PolicyLayer};
use crate::http::fingerprint::{ContentTypePart, FingerprintPolicy};
use crate::http::layer::IdempotencyLayer;
use crate::http::scope::{header_scope, Scope};

/// Adds the settings both the top and each endpoint may set to a struct, and `apply`, which
/// sets those the file gives on a layer. (Not `#[serde(flatten)]`: it cannot refuse unknown
/// fields, and loses the place of a mistake.)
macro_rules! with_settings {
    ($(#[$meta:meta])* $vis:vis struct $name:ident { $($body:tt)* }) => {
        $(#[$meta])*
        $vis struct $name {
            $($body)*
            required: Option<bool>,
            key_header: Option<Header>,
            lease: Option<Dur>,
            mismatch_status: Option<Status>,
            not_stored_status: Option<Status>,
            release_not_stored: Option<bool>,
            body_limit: Option<Size>,
            response_limit: Option<Size>,
            handler_timeout: Option<HandlerTimeout>,
            stream_timeout: Option<Dur>,
            store_timeout: Option<Dur>,
            fail_open: Option<bool>,
            cancel_on_disconnect: Option<bool>,
            transactional_completion: Option<bool>,
            key_in_extensions: Option<bool>,
            scope: Option<ScopeSpec>,
            fingerprint: Option<FingerprintSpec>,
        }

        impl $name {
            fn apply(&self, layer: IdempotencyLayer) -> IdempotencyLayer {
                type L = IdempotencyLayer;
                let s = self;
                let mut layer = set(layer, s.required, L::with_key_required);
                layer = set(layer, s.key_header.as_ref().map(|v| v.0.clone()), L::with_key_header);
                layer = set(layer, s.lease.map(|v| v.0), L::with_lease);
                layer = set(layer, s.mismatch_status.map(|v| v.0), L::with_mismatch_status);
                layer = set(layer, s.not_stored_status.map(|v| v.0), L::with_not_stored_status);
                layer = set(layer, s.release_not_stored, L::with_release_not_stored);
                layer = set(layer, s.body_limit.map(|v| v.0), L::with_body_limit);
                layer = set(layer, s.response_limit.map(|v| v.0), L::with_response_limit);
                layer = set(layer, s.handler_timeout.map(|v| v.0), L::with_handler_timeout);
                layer = set(layer, s.stream_timeout.map(|v| v.0), L::with_stream_timeout);
                layer = set(layer, s.store_timeout.map(|v| v.0), L::with_store_timeout);
                layer = set(layer, s.fail_open, L::with_fail_open);
                layer = set(layer, s.cancel_on_disconnect, L::with_cancel_on_disconnect);
                layer = set(layer, s.transactional_completion, L::with_transactional_completion);
                layer = set(layer, s.key_in_extensions, L::with_key_in_extensions);
                match &s.scope {
                    Some(ScopeSpec::Host) => layer = layer.set_scope(Some(Arc::new(Scope::host()))),
                    Some(ScopeSpec::Header(name)) => layer = layer.set_scope(Some(Arc::new(header_scope(name.0.clone())))),
                    Some(ScopeSpec::None) => layer = layer.set_scope(None),
                    None => {}
                }
                set(layer, s.fingerprint.as_ref().map(|v| v.0.clone()), L::with_fingerprint)
            }
        }
    };
}

/// `layer` with `setter` given the file's value, if the file gives one.
fn set<T>(
    layer: IdempotencyLayer,
    value: Option<T>,
    setter: fn(IdempotencyLayer, T) -> IdempotencyLayer,
) -> IdempotencyLayer {
    value.into_iter().fold(layer, setter)
}

with_settings! {
/// The settings of the layer and of each endpoint, as a policy file states them (crate feature
/// `policy`; `policy-yaml` and `policy-toml` add those formats). Turned into one layer for a
/// whole router by [`PolicyLayer::from_policy`].
///
/// The file has an `idempotency` section at its top: the settings every endpoint starts from,
/// and `endpoints`, each a `path` pattern, its `method`s and the settings it changes. Unknown
/// fields are refused; a mistake is reported with its place in the file and the field's path.
/// The [policy file guide](crate::guide::policy_file) lists every field.
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, Policy, PolicyLayer};
///
/// let policy = Policy::from_json_str(r#"{
///   "idempotency": {
///     "ttl": "24h",
///     "endpoints": [
///       { "path": "/payments", "method": "POST", "required": true, "ttl_override": "7d" },
///       { "path": "/posts/{id}/comments", "method": "POST", "required": false }
///     ]
///   }
/// }"#)?;
/// let layer = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy)?;
/// # let _ = layer;
/// # Ok::<(), tower_idempotency::PolicyError>(())
/// ```
///
/// An application with a configuration file of its own can hold a `Policy` in it (its
/// `idempotency` section deserializes into one) and skip the loaders here.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// The methods of an endpoint that names none.
    method: Option<Methods>,
    /// How long a stored response is replayed.
    ttl: Option<Dur>,
    /// The bound on handlers running at once, all endpoints together.
    max_in_flight: Option<u32>,
    /// Refuse a keyed request that matches no endpoint (`PolicyLayer::with_refuse_unmatched`).
    refuse_unmatched: Option<bool>,
    /// `PolicyLayer::with_ignore_trailing_slash`.
    ignore_trailing_slash: Option<bool>,
    #[serde(default)]
    endpoints: Vec<EndpointSpec>,
}
}

with_settings! {
/// One endpoint.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointSpec {
    path: PathPattern,
    method: Option<Methods>,
    /// The retention for this endpoint.
    ttl_override: Option<Dur>,
}
}

/// The whole file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    idempotency: Policy,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ScopeSpec {
    /// The normalised host.
    Host,
    /// No scope, even if the base layer has one.
    None,
    /// A header's value.
    Header(Header),
}

/// `fingerprint`: a [`FingerprintPolicy`], its fields checked together at load.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "FingerprintFields")]
struct FingerprintSpec(FingerprintPolicy);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FingerprintFields {
    content_type: Option<ContentTypeSpec>,
    #[serde(default)]
    headers: Vec<Header>,
    body: Option<BodySpec>,
    /// `json_body_only`: implies `body: json`.
    json_only: Option<Vec<JsonPointer>>,
    /// `json_body_except`: implies `body: json`.
    json_except: Option<Vec<JsonPointer>>,
}

/// `body`: `true` (its bytes), `false` (not at all) or `json` (by its meaning).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodySpec {
    Bytes,
    Ignored,
    Json,
}

impl<'de> Deserialize<'de> for BodySpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BodyVisitor;
        impl Visitor<'_> for BodyVisitor {
            type Value = BodySpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("true, false or json")
            }
            fn visit_bool<E: de::Error>(self, counted: bool) -> Result<BodySpec, E> {
                Ok(if counted {
                    BodySpec::Bytes
                } else {
                    BodySpec::Ignored
                })
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<BodySpec, E> {
                match value {
                    "json" => Ok(BodySpec::Json),
                    other => Err(E::invalid_value(de::Unexpected::Str(other), &self)),
                }
            }
        }
        deserializer.deserialize_any(BodyVisitor)
    }
}

impl TryFrom<FingerprintFields> for FingerprintSpec {
    type Error = String;

    fn try_from(fields: FingerprintFields) -> Result<Self, String> {
        let mut policy = FingerprintPolicy::new();
        policy.content_type = match fields.content_type {
            None | Some(ContentTypeSpec::Full) => ContentTypePart::Full,
            Some(ContentTypeSpec::MediaType) => ContentTypePart::MediaType,
            Some(ContentTypeSpec::Ignored) => ContentTypePart::Ignored,
        };
        for header in fields.headers {
            policy = policy.with_header(header.0);
        }
        let body = fields
            .body
            .unwrap_or(if fields.json_only.is_some() || fields.json_except.is_some() {
                BodySpec::Json
            } else {
                BodySpec::Bytes
            });
        policy = match (body, fields.json_only, fields.json_except) {
            (_, Some(_), Some(_)) => {
                return Err("json_only and json_except cannot both be given: choose the members that count, or those that do not".into())
            }
            (BodySpec::Bytes | BodySpec::Ignored, Some(_), _) | (BodySpec::Bytes | BodySpec::Ignored, _, Some(_)) => {
                return Err("json_only and json_except choose members of a JSON body: they need `body: json` (or no `body`)".into())
            }
            (BodySpec::Json, Some(only), None) => policy.json_body_only(only),
            (BodySpec::Json, None, Some(except)) => policy.json_body_except(except),
            (BodySpec::Json, None, None) => policy.json_body(),
            (BodySpec::Ignored, None, None) => policy.without_body(),
            (BodySpec::Bytes, None, None) => policy,
        };
        Ok(Self(policy))
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ContentTypeSpec {
    Full,
    MediaType,
    Ignored,
}

impl PolicyLayer {
    /// One layer for a whole router from a [`Policy`]: `base` (the store, and anything set in
    /// code such as a scope function or `with_cacheable`) with the file's top-level settings,
    /// and each endpoint that plus its own. See [`PolicyLayer`] for how requests find their
    /// endpoint.
    ///
    /// A `scope` in the file replaces a scope set in code on `base`: each such replacement is
    /// logged as a warning here, at load (the file's scope may be meant, but a file copied from
    /// another service can also turn a per-tenant scope into a shared one).
    pub fn from_policy(base: IdempotencyLayer, policy: &Policy) -> Result<Self, PolicyError> {
        if base.config.scope.is_some() {
            warn_scope_replaced(policy);
        }
        let base = set(
            policy.apply(base),
            policy.ttl.map(|ttl| ttl.0),
            IdempotencyLayer::with_retention,
        );
        let base = set(base, policy.max_in_flight, IdempotencyLayer::with_max_in_flight);
        let default_methods = match &policy.method {
            Some(methods) => methods.0.clone(),
            None => base.config.methods.clone(),
        };
        let mut layer = PolicyLayer::new(base.clone())
            .with_refuse_unmatched(policy.refuse_unmatched.unwrap_or(false))
            .with_ignore_trailing_slash(policy.ignore_trailing_slash.unwrap_or(false));
        for endpoint in &policy.endpoints {
            let methods = endpoint
                .method
                .as_ref()
                .map_or_else(|| default_methods.clone(), |m| m.0.clone());
            let ttl = endpoint.ttl_override.map(|ttl| ttl.0);
            let configured = set(
                endpoint.apply(base.clone()),
                ttl,
                IdempotencyLayer::with_retention,
            );
            layer = layer.push_layer(methods, endpoint.path.clone(), configured)?;
        }
        Ok(layer)
    }
}

/// Warns of each scope in `policy` that replaces the one set in code: the top level's, or, if
/// the top sets none, each endpoint's.
fn warn_scope_replaced(policy: &Policy) {
    let describe = |scope: &ScopeSpec| match scope {
        ScopeSpec::Host => "`host` (the request's host)".to_owned(),
        ScopeSpec::Header(name) => format!("`header: {}`", name.0),
        ScopeSpec::None => "`none`: keys of every caller share one namespace".to_owned(),
    };
    if let Some(scope) = &policy.scope {
        tracing::warn!(
            field = "idempotency.scope",
            "the policy file's scope replaces the scope set in code on every endpoint: {}",
            describe(scope)
        );
        return;
    }
    for (i, endpoint) in policy.endpoints.iter().enumerate() {
        if let Some(scope) = &endpoint.scope {
            tracing::warn!(
                field = %format_args!("idempotency.endpoints[{i}].scope"),
                path = &*endpoint.path.source,
                "the policy file's scope replaces the scope set in code on endpoint {}: {}",
                endpoint.path.source,
                describe(scope)
            );
        }
    }
}

impl Policy {
    /// Parses a policy file in JSON.
    pub fn from_json_str(text: &str) -> Result<Self, PolicyError> {
        Self::parse_json(text, "JSON")
    }

    /// Parses a policy file in YAML (crate feature `policy-yaml`).
    #[cfg(feature = "policy-yaml")]
    pub fn from_yaml_str(text: &str) -> Result<Self, PolicyError> {
        Self::parse_yaml(text, "YAML")
    }

    /// Parses a policy file in TOML (crate feature `policy-toml`).
    #[cfg(feature = "policy-toml")]
    pub fn from_toml_str(text: &str) -> Result<Self, PolicyError> {
        Self::parse_toml(text, "TOML")
    }

    /// Reads and parses a policy file, in the format its extension names: `.json`, `.yaml` or
    /// `.yml` (feature `policy-yaml`), `.toml` (feature `policy-toml`). Errors name the file.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self, PolicyError> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let parse: fn(&str, &str) -> Result<Self, PolicyError> = match extension {
            "json" => Self::parse_json,
            #[cfg(feature = "policy-yaml")]
            "yaml" | "yml" => Self::parse_yaml,
            #[cfg(feature = "policy-toml")]
            "toml" => Self::parse_toml,
            // Not a format this build reads: a known one whose feature is off, or none.
            unread => {
                let reason = match unread {
                    "yaml" | "yml" => "YAML policy files need the crate feature `policy-yaml`",
                    "toml" => "TOML policy files need the crate feature `policy-toml`",
                    _ => "the extension names no format: .json, .yaml, .yml or .toml",
                };
                let reason = reason.to_owned();
                return Err(PolicyError::Format { path: origin, reason });
            }
        };
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Io {
            path: origin.clone(),
            source,
        })?;
        parse(&text, &origin)
    }

    fn parse_json(text: &str, origin: &str) -> Result<Self, PolicyError> {
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let parsed = serde_path_to_error::deserialize::<_, Document>(&mut deserializer)
            .map_err(split)
            .and_then(|document| {
                deserializer.end().map_err(|e| (DOCUMENT.to_owned(), e))?;
                Ok(document)
            });
        parsed.map(|d| d.idempotency).map_err(|(field, error)| {
            let (line, column) = (error.line(), error.column());
            let message = error.to_string();
            let suffix = format!(" at line {line} column {column}");
            let message = message.strip_suffix(&suffix).unwrap_or(&message).to_owned();
            PolicyError::Parse {
                origin: origin.to_owned(),
                field,
                line: (line > 0).then_some(line),
                column: (line > 0).then_some(column),
                message,
            }
        })
    }

    #[cfg(feature = "policy-yaml")]
    fn parse_yaml(text: &str, origin: &str) -> Result<Self, PolicyError> {
        let mut path = None;
        let parsed = serde_saphyr::with_deserializer_from_str(text, |deserializer| {
            serde_path_to_error::deserialize::<_, Document>(deserializer).map_err(|error| {
                path = Some(field(error.path()));
                error.into_inner()
            })
        });
        parsed.map(|d| d.idempotency).map_err(|error| {
            let location = error.location();
            let usize_of = |n: u64| usize::try_from(n).ok().filter(|n| *n > 0);
            let line = location.and_then(|l| usize_of(l.line()));
            let column = location.and_then(|l| usize_of(l.column()));
            // The place is in the error already; without the message's own copy of it.
            let message = error.without_snippet().to_string();
            let suffix = format!(" at line {}, column {}", line.unwrap_or(0), column.unwrap_or(0));
            let message = message.strip_suffix(&suffix).unwrap_or(&message).to_owned();
            PolicyError::Parse {
                origin: origin.to_owned(),
                field: path.unwrap_or_else(|| DOCUMENT.to_owned()),
                line,
                column,
                message,
            }
        })
    }

    #[cfg(feature = "policy-toml")]
    fn parse_toml(text: &str, origin: &str) -> Result<Self, PolicyError> {
        let parsed = toml::Deserializer::parse(text)
            .map_err(|e| (DOCUMENT.to_owned(), e))
            .and_then(|deserializer| {
                serde_path_to_error::deserialize::<_, Document>(deserializer).map_err(split)
            });
        parsed.map(|d| d.idempotency).map_err(|(field, error)| {
            let (line, column) = match error.span() {
                Some(span) => line_and_column(text, span.start),
                None => (None, None),
            };
            PolicyError::Parse {
                origin: origin.to_owned(),
                field,
                line,
                column,
                message: error.message().trim_end().to_owned(),
            }
        })
    }
}

/// The field named for an error that is not inside any.
const DOCUMENT: &str = "(document)";

fn split<E>(error: serde_path_to_error::Error<E>) -> (String, E) {
    (field(error.path()), error.into_inner())
}

fn field(path: &serde_path_to_error::Path) -> String {
    let field = path.to_string();
    if field == "." {
        DOCUMENT.to_owned()
    } else {
        field
    }
}

/// The 1-based line and column (in characters) of a byte offset.
#[cfg(feature = "policy-toml")]
fn line_and_column(text: &str, offset: usize) -> (Option<usize>, Option<usize>) {
    let Some(before) = text.get(..offset) else {
        return (None, None);
    };
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (Some(line), Some(before[line_start..].chars().count() + 1))
}

// The field types: each parses and checks its value where it is read, so a mistake is reported
// at its place in the file.

/// A duration: a number then a unit, repeated: `30s`, `1500ms`, `1h30m`, `7d`.
#[derive(Debug, Clone, Copy)]
struct Dur(Duration);

/// A size in bytes: a number (bytes), or a string with a unit `B`, `KiB`, `MiB`, `GiB`.
#[derive(Debug, Clone, Copy)]
struct Size(usize);

/// The status of a rejection: a status code, 400 to 599.
#[derive(Debug, Clone, Copy)]
struct Status(StatusCode);

/// A handler timeout: a duration of at least 100 ms.
#[derive(Debug, Clone, Copy)]
struct HandlerTimeout(Duration);

#[derive(Debug, Clone)]
struct Header(HeaderName);

/// One method or a list of them.
#[derive(Debug, Clone)]
struct Methods(Vec<Method>);

pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = |why: &str| {
        format!("invalid duration {text:?}: {why}; write a number then a unit (ms, s, m, h, d), as \"30s\", \"24h\" or \"1h30m\"")
    };
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad("it is empty"));
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(bad("a number is missing"));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| bad("the number is too large"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let unit = rest[..unit_len].trim();
        rest = &rest[unit_len..];
        let part = match unit {
            "ms" => Some(Duration::from_millis(number)),
            "s" => Some(Duration::from_secs(number)),
            "m" => number.checked_mul(60).map(Duration::from_secs),
            "h" => number.checked_mul(3600).map(Duration::from_secs),
            "d" => number.checked_mul(86_400).map(Duration::from_secs),
            "" => return Err(bad("the unit is missing")),
            _ => return Err(bad(&format!("unknown unit {unit:?}"))),
        };
        total = part
            .and_then(|part| total.checked_add(part))
            .ok_or_else(|| bad("it is too long"))?;
    }
    Ok(total)
}

fn parse_size(text: &str) -> Result<usize, String> {
    let bad = |why: &str| {
        format!("invalid size {text:?}: {why}; write bytes as a number, or a number then B, KiB, MiB or GiB")
    };
    let text = text.trim();
    let digits = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    if digits == 0 {
        return Err(bad("a number is missing"));
    }
    let number: usize = text[..digits]
        .parse()
        .map_err(|_| bad("the number is too large"))?;
    let factor: usize = match text[digits..].trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        unit => return Err(bad(&format!("unknown unit {unit:?}"))),
    };
    number.checked_mul(factor).ok_or_else(|| bad("it is too large"))
}

fn parse_method(text: &str) -> Result<Method, String> {
    const KNOWN: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::CONNECT,
        Method::OPTIONS,
        Method::TRACE,
        Method::PATCH,
    ];
    // An unknown name is far more likely a typo than an extension method.
    KNOWN
        .into_iter()
        .find(|m| m.as_str().eq_ignore_ascii_case(text.trim()))
        .ok_or_else(|| format!("unknown HTTP method {text:?}; expected one of POST, PUT, PATCH, DELETE, GET, HEAD, OPTIONS, CONNECT, TRACE"))
}

fn status_from(number: u64) -> Result<StatusCode, String> {
    let status = u16::try_from(number)
        .ok()
        .and_then(|n| StatusCode::from_u16(n).ok())
        .ok_or_else(|| format!("invalid status {number}: a status code is 100 to 999"))?;
    rejection_status_error(status).map_or(Ok(status), Err)
}

/// A visitor for a value written as a string (and, for some, a number).
struct StrVisitor<T> {
    expecting: &'static str,
    from_str: fn(&str) -> Result<T, String>,
    from_u64: Option<fn(u64) -> Result<T, String>>,
}

impl<'de, T> Visitor<'de> for StrVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        (self.from_str)(v).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        match self.from_u64 {
            Some(from_u64) => from_u64(v).map_err(E::custom),
            None => Err(E::invalid_type(de::Unexpected::Unsigned(v), &self)),
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(E::invalid_type(de::Unexpected::Signed(v), &self)),
        }
    }
}

/// A value written as a string (and, with `from_u64`, as a number), read by [`StrVisitor`].
fn from_text<'de, D: Deserializer<'de>, T>(
    deserializer: D,
    expecting: &'static str,
    from_str: fn(&str) -> Result<T, String>,
    from_u64: Option<fn(u64) -> Result<T, String>>,
) -> Result<T, D::Error> {
    let visitor = StrVisitor {
        expecting,
        from_str,
        from_u64,
    };
    match from_u64 {
        Some(_) => deserializer.deserialize_any(visitor),
        None => deserializer.deserialize_str(visitor),
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let expecting = "a duration string such as \"30s\" or \"24h\"";
        from_text(deserializer, expecting, parse_duration, None).map(Dur)
    }
}

impl<'de> Deserialize<'de> for HandlerTimeout {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let from_str = |s: &str| {
            let timeout = parse_duration(s)?;
            handler_timeout_error(timeout).map_or(Ok(timeout), Err)
        };
        let expecting = "a duration string such as \"30s\", at least \"100ms\"";
        from_text(deserializer, expecting, from_str, None).map(HandlerTimeout)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let from_u64 = |n: u64| usize::try_from(n).map_err(|_| format!("invalid size {n}: too large"));
        let expecting = "a size: bytes as a number, or a string such as \"64KiB\"";
        from_text(deserializer, expecting, parse_size, Some(from_u64)).map(Size)
    }
}

impl<'de> Deserialize<'de> for Status {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let from_str = |s: &str| {
            let invalid = || format!("invalid status {s:?}: a status code is 100 to 999");
            status_from(s.trim().parse().map_err(|_| invalid())?)
        };
        let expecting = "an HTTP status code such as 409 or 422";
        from_text(deserializer, expecting, from_str, Some(status_from)).map(Status)
    }
}

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let from_str =
            |s: &str| HeaderName::from_bytes(s.as_bytes()).map_err(|_| format!("invalid header name {s:?}"));
        let expecting = "a header name such as \"x-tenant-id\"";
        from_text(deserializer, expecting, from_str, None).map(Header)
    }
}

impl<'de> Deserialize<'de> for PathPattern {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let from_str = |s: &str| PathPattern::parse(s).map_err(|e| e.to_string());
        let expecting = "a path pattern such as \"/payments/{id}\"";
        from_text(deserializer, expecting, from_str, None)
    }
}

impl<'de> Deserialize<'de> for Methods {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MethodsVisitor;

        impl<'de> Visitor<'de> for MethodsVisitor {
            type Value = Methods;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an HTTP method such as \"POST\", or a list of them")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Methods, E> {
                parse_method(v).map(|m| Methods(vec![m])).map_err(E::custom)
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Methods, A::Error> {
                let mut methods = Vec::new();
                while let Some(name) = seq.next_element::<String>()? {
                    let method = parse_method(&name).map_err(de::Error::custom)?;
                    if !methods.contains(&method) {
                        methods.push(method);
                    }
                }
                if methods.is_empty() {
                    return Err(de::Error::custom("the list of methods is empty"));
                }
                Ok(Methods(methods))
            }
        }

        deserializer.deserialize_any(MethodsVisitor)
    }
}

/// The fuzz target's check of the policy file (`fuzz/fuzz_targets/policy.rs`, and
/// `tests/fuzz_corpora.rs` on every checked-in input). The first byte picks what the rest is:
/// a JSON, YAML or TOML file, a path pattern and a path (one a line), a duration or a size.
/// Nothing panics: a file that loads builds its layer or is refused with an error, never a
/// panic in a setter; a pattern matches the path it describes; a duration or size read back
/// from its plain form is the same.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let file = match selector % 6 {
        0 => Some(Policy::from_json_str(text)),
        #[cfg(feature = "policy-yaml")]
        1 => Some(Policy::from_yaml_str(text)),
        #[cfg(feature = "policy-toml")]
        2 => Some(Policy::from_toml_str(text)),
        3 => {
            let (pattern, path) = text.split_once('\n').unwrap_or((text, "/"));
            check_pattern(pattern, path);
            None
        }
        4 => {
            if let Ok(duration) = parse_duration(text) {
                let plain = match duration.subsec_millis() {
                    0 => format!("{}s", duration.as_secs()),
                    ms => format!("{}s{ms}ms", duration.as_secs()),
                };
                assert_eq!(parse_duration(&plain), Ok(duration), "{text:?}");
                assert_eq!(parse_duration(&format!(" {text}\t")), Ok(duration));
            }
            None
        }
        _ => {
            if let Ok(size) = parse_size(text) {
                assert_eq!(parse_size(&size.to_string()), Ok(size), "{text:?}");
                if size % 1024 == 0 {
                    assert_eq!(parse_size(&format!("{}KiB", size / 1024)), Ok(size));
                }
            }
            None
        }
    };
    if let Some(file) = file {
        let base = IdempotencyLayer::new(crate::store::memory::MemoryStore::new());
        let layer = file.and_then(|policy| PolicyLayer::from_policy(base, &policy));
        let _ = layer.map_err(|error| error.to_string());
    }
}

/// A pattern that parses matches the path it describes (each parameter and the wildcard given
/// a value), and only paths from `/`; one that does not parse is refused with its text.
#[cfg(any(test, feature = "fuzzing"))]
fn check_pattern(source: &str, path: &str) {
    let pattern = match PathPattern::parse(source) {
        Ok(pattern) => pattern,
        Err(error) => {
            assert!(error.to_string().contains(&format!("{source:?}")));
            return;
        }
    };
    if pattern.matches(path) {
        assert!(path.starts_with('/'));
    }
    let parts: Vec<&str> = source[1..].split('/').collect();
    let described: Vec<&str> = parts
        .iter()
        .map(|part| match *part {
            "*" => "rest",
            p if p.starts_with("{*") => "rest",
            p if p.starts_with('{') || p.starts_with(':') => "value",
            p => p,
        })
        .collect();
    let described = format!("/{}", described.join("/"));
    assert!(
        pattern.matches(&described),
        "{source:?} does not match {described:?}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_timeout_is_a_setting_of_the_file() {
        let policy =
            Policy::from_json_str(r#"{ "idempotency": { "handler_timeout": "20s", "endpoints": [] } }"#)
                .expect("a valid policy");
        let base = crate::IdempotencyLayer::new(crate::MemoryStore::new());
        let layer = PolicyLayer::from_policy(base.clone(), &policy).expect("a layer");
        assert_eq!(
            layer.base().config.stream_timeout(),
            Duration::from_secs(20),
            "the handler timeout's"
        );
        let policy =
            Policy::from_json_str(r#"{ "idempotency": { "stream_timeout": "5m", "endpoints": [] } }"#)
                .expect("a valid policy");
        let layer = PolicyLayer::from_policy(base, &policy).expect("a layer");
        assert_eq!(layer.base().config.stream_timeout(), Duration::from_secs(300));
    }

    #[test]
    fn durations_are_a_number_then_a_unit() {
        // What a duration adds up to: `durations_are_the_sum_of_their_parts`; here, what it says
        // when it cannot (an unknown unit: tests/policy.rs).
        for (bad, why) in [
            ("", "empty"),
            ("30", "unit is missing"),
            ("h", "number is missing"),
            ("99999999999999999999s", "too large"),
        ] {
            let error = parse_duration(bad).unwrap_err();
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn sizes_methods_and_statuses_are_checked() {
        // What a size comes to: `sizes_are_a_number_times_a_unit`; a unit, a method or a
        // status refused: tests/policy.rs, `unknown_fields_and_bad_values_are_refused_by_name`.
        assert_eq!(parse_method("post"), Ok(Method::POST));
        assert_eq!(status_from(422), Ok(StatusCode::UNPROCESSABLE_ENTITY));
        assert!(status_from(70_000).is_err());
    }

    /// A rejection status that is not a 4xx or 5xx, or a handler timeout under 100 ms, can only
    /// hurt: refused at load, with the field's place, never applied or panicking later (a
    /// `mismatch_status` of 200 and a `handler_timeout` of 50ms: tests/policy.rs).
    #[test]
    fn settings_that_can_only_hurt_are_refused_at_load() {
        for status in [100, 200, 204, 302] {
            let error = status_from(status).unwrap_err();
            assert!(error.contains("use a 4xx or 5xx status"), "{status}: {error}");
        }
        for (text, refused) in [
            (
                r#"{"idempotency": {"endpoints": [{"path": "/p", "not_stored_status": "301"}]}}"#,
                Some("not_stored_status"),
            ),
            (
                r#"{"idempotency": {"handler_timeout": "100ms", "mismatch_status": 422}}"#,
                None,
            ),
        ] {
            match (Policy::from_json_str(text), refused) {
                (Ok(_), None) => {}
                (Err(error), Some(field)) => assert!(error.to_string().contains(field), "{text}: {error}"),
                (answer, _) => panic!("{text}: {answer:?}"),
            }
        }
    }

    use proptest::prelude::*;

    /// A pattern segment, and a path segment it matches.
    fn segments() -> impl Strategy<Value = (String, String)> {
        prop_oneof![
            "[a-z0-9._~-]{0,6}".prop_map(|l| (l.clone(), l)),
            ("[a-zA-Z0-9_]{1,6}", "[a-z0-9]{1,4}").prop_map(|(n, v)| (format!("{{{n}}}"), v)),
            ("[a-zA-Z0-9_]{1,6}", "[a-z0-9]{1,4}").prop_map(|(n, v)| (format!(":{n}"), v)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// A duration written as parts (any units, any spaces) is their sum; one too long for a
        /// `Duration` is refused, never wrapped.
        #[test]
        fn durations_are_the_sum_of_their_parts(
            parts in proptest::collection::vec((0u64..100_000, prop_oneof![Just("ms"), Just("s"), Just("m"), Just("h"), Just("d")], " {0,1}", " {0,1}"), 1..5),
            huge in any::<u64>(),
        ) {
            let text: String = parts.iter().map(|(n, unit, a, b)| format!("{a}{n}{b}{unit}")).collect();
            let sum = parts.iter().map(|(n, unit, _, _)| match *unit {
                "ms" => Duration::from_millis(*n),
                "s" => Duration::from_secs(*n),
                "m" => Duration::from_secs(n * 60),
                "h" => Duration::from_secs(n * 3600),
                _ => Duration::from_secs(n * 86_400),
            }).sum::<Duration>();
            prop_assert_eq!(parse_duration(&text), Ok(sum), "{:?}", text);
            let days = parse_duration(&format!("{huge}d"));
            prop_assert_eq!(days.is_ok(), huge.checked_mul(86_400).is_some());
            let mut data = vec![4];
            data.extend_from_slice(text.as_bytes());
            check(&data);
        }

        /// A size is its number times its unit; one past `usize` is refused.
        #[test]
        fn sizes_are_a_number_times_a_unit(n in any::<u32>(), unit in prop_oneof![Just(("", 1u64)), Just(("B", 1)), Just(("KiB", 1 << 10)), Just(("MiB", 1 << 20)), Just(("GiB", 1 << 30))], space in " {0,2}") {
            let expected = usize::try_from(u64::from(n) * unit.1).ok();
            prop_assert_eq!(parse_size(&format!("{n}{space}{}", unit.0)).ok(), expected);
            let past = format!("{}0{}", usize::MAX, unit.0);
            prop_assert!(parse_size(&past).is_err());
        }

        /// A pattern matches the paths it describes (a parameter any non-empty segment, a
        /// trailing wildcard any rest), and no path with a literal changed, a segment more or
        /// less (without a wildcard), or a parameter left empty.
        #[test]
        fn patterns_match_exactly_the_paths_they_describe(
            segments in proptest::collection::vec(segments(), 1..5),
            wildcard in prop_oneof![Just(None), Just(Some("*")), Just(Some("{*rest}"))],
            rest in "[a-z0-9/]{0,8}",
            change in any::<prop::sample::Index>(),
        ) {
            let mut source = segments.iter().map(|(s, _)| format!("/{s}")).collect::<String>();
            let mut path = segments.iter().map(|(_, p)| format!("/{p}")).collect::<String>();
            if let Some(wildcard) = wildcard {
                source.push_str(&format!("/{wildcard}"));
                path.push_str(&format!("/{rest}"));
            }
            let pattern = PathPattern::parse(&source).unwrap();
            prop_assert!(pattern.matches(&path), "{} {}", source, path);
            let longer = format!("{path}/x");
            prop_assert_eq!(pattern.matches(&longer), wildcard.is_some());
            let i = change.index(segments.len());
            let (segment, value) = &segments[i];
            let mut changed: Vec<String> = segments.iter().map(|(_, p)| p.clone()).collect();
            changed[i] = if segment == value { format!("{value}Z") } else { String::new() };
            let changed = format!("/{}", changed.join("/"));
            prop_assert!(!pattern.matches(&changed), "{} {}", source, changed);
            check(format!("\x03{source}\n{path}").as_bytes());
        }

        /// Any bytes under each selector (a policy file in JSON, YAML, TOML, a pattern, a
        /// duration, a size): the fuzz check. A policy that loads builds a layer or an error,
        /// never a panic.
        #[test]
        fn any_input_passes_the_fuzz_check(selector in 0u8..6, text in "[ -~\n]{0,60}") {
            let mut data = vec![selector];
            data.extend_from_slice(text.as_bytes());
            check(&data);
        }

        /// Policy files of any setting the format allows: loading either refuses the file or
        /// gives a policy whose layer builds (a setter that panics on a value the file let
        /// through would fail here).
        #[test]
        fn every_loadable_policy_builds_its_layer(
            fields in proptest::collection::vec((
                prop_oneof![
                    Just("lease"), Just("ttl"), Just("handler_timeout"), Just("stream_timeout"), Just("store_timeout"),
                    Just("mismatch_status"), Just("not_stored_status"), Just("body_limit"), Just("response_limit"),
                    Just("max_in_flight"), Just("required"), Just("key_header"), Just("scope"), Just("method"),
                ],
                prop_oneof![
                    (0u64..100_000).prop_map(|n| n.to_string()),
                    (0u64..1000, prop_oneof![Just("ms"), Just("s"), Just("h"), Just("d"), Just("KiB"), Just("GiB")]).prop_map(|(n, u)| format!("\"{n}{u}\"")),
                    Just("true".to_owned()), Just("\"x-tenant\"".to_owned()), Just("\"host\"".to_owned()),
                    Just("\"POST\"".to_owned()), Just("[]".to_owned()), Just("\"\"".to_owned()),
                ],
            ), 0..5),
        ) {
            let settings: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
            let settings = settings.join(", ");
            let text = format!(r#"{{"idempotency": {{ {settings}{}"endpoints": [{{"path": "/p", {settings}}}] }}}}"#, if settings.is_empty() { "" } else { ", " });
            let text = text.replace("{\"path\": \"/p\", }", "{\"path\": \"/p\"}");
            let mut data = vec![0];
            data.extend_from_slice(text.as_bytes());
            check(&data);
        }
    }
}
