//! The tower adapter: HTTP in and out of the [`Coordinator`](crate::Coordinator).
//!
//! [`layer`] holds the settings, [`service`] turns a request into a key, a fingerprint and a
//! claim, [`future`] carries a claimed run past a client that hangs up, [`response_body`] is the
//! response body the layer hands on and turns the handler's response into what is stored,
//! [`stored`] is the stored form of a response and [`replay`] sends it again, [`prefer`] the wait
//! a retry of a running request asks for, [`retry_after`] when to retry one, [`response`] the
//! rejections (problem+json, or gRPC's form), [`grpc`] what gRPC calls need beyond that (their
//! status in the trailers), [`body`] the request body and bounded buffering, and
//! [`transactional`] the claim handed to a handler that stores its response in its own
//! transaction. [`fingerprint`] decides what makes two requests the same, [`scope`]
//! builds the common scopes, [`endpoints`] applies settings per method and path under one
//! layer ([`unmatched`] remembers the paths of keyed requests that matched none, to log each
//! once), and `policy` (feature `policy`) loads those settings from a file. Nothing in the
//! core (`coordinator`, `store`, `key`, `fingerprint`) depends on
//! this module.

pub(crate) mod body;
pub(crate) mod config;
pub(crate) mod endpoints;
pub(crate) mod fingerprint;
pub(crate) mod future;
pub(crate) mod grpc;
pub(crate) mod layer;
#[cfg(feature = "policy")]
pub(crate) mod policy;
pub(crate) mod prefer;
pub(crate) mod replay;
pub(crate) mod response;
pub(crate) mod response_body;
pub(crate) mod retry_after;
pub(crate) mod scope;
pub(crate) mod service;
pub(crate) mod stored;
pub(crate) mod transactional;
pub(crate) mod unmatched;
