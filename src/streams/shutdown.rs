//! The future a consumer process stops on: SIGTERM or Ctrl-C.

use std::future::Future;

/// A future that completes at the process's first SIGTERM (what `docker stop`, Kubernetes and
/// systemd send) or SIGINT (Ctrl-C), for [`StreamConsumer::run`](crate::StreamConsumer::run)'s
/// `shutdown`, or any loop that should finish what it holds and stop. Elsewhere than Unix,
/// Ctrl-C alone.
///
/// The signals are caught from this call on, not from the future's first poll: a SIGTERM that
/// comes while the consumer is still connecting stops it once it runs, rather than killing the
/// process with the default action (and leaving whatever it held to a takeover a lease later).
/// Call it early, inside a Tokio runtime. Errs if the signal handlers cannot be installed.
///
/// ```no_run
/// # async fn run(consumer: tower_idempotency::StreamConsumer) -> Result<(), Box<dyn std::error::Error>> {
/// let shutdown = tower_idempotency::shutdown_signal()?;
/// consumer.run(shutdown, |_message, _ticket| async { Ok("done".into()) }).await?;
/// # Ok(()) }
/// ```
pub fn shutdown_signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
