//! The tower adapter: HTTP in and out of the [`Coordinator`](crate::Coordinator).
//!
//! [`layer`] holds the settings, [`service`] turns a request into a key, a fingerprint and a
//! claim, [`future`] carries a claimed run past a client that hangs up, [`capture`] turns the
//! handler's response into what is stored, [`replay`] is the stored form of a response,
//! [`response`] the problem+json rejections, [`grpc`] what gRPC calls need beyond that (their
//! status in the trailers, rejections in gRPC's form), [`body`] the request and response bodies the
//! layer hands on, and [`transactional`] the claim handed to a handler that stores its response
//! in its own transaction. Nothing in the core (`coordinator`, `store`, `key`, `fingerprint`) depends on
//! this module.

pub(crate) mod body;
pub(crate) mod capture;
pub(crate) mod config;
pub(crate) mod future;
pub(crate) mod grpc;
pub(crate) mod layer;
pub(crate) mod replay;
pub(crate) mod response;
pub(crate) mod service;
pub(crate) mod transactional;
