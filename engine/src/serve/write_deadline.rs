//! A write deadline on every connection. `--stall-timeout` cuts a *request* whose client
//! stops reading (the model stops and the cut is counted), but the connection would live on:
//! the cut's error event, or the last bytes of an answer that was complete, wait forever to
//! be written to a socket nobody drains, holding a file descriptor, a task and the HTTP
//! layer's buffers until shutdown. Here a write (or flush) that makes no progress for twice
//! `--stall-timeout` fails with `TimedOut`, and the HTTP layer drops the connection. Twice:
//! a socket blocks a little before its request's backlog does, and the request must be cut
//! (and counted) as stalled before its connection goes. Reads are untouched: an idle
//! keep-alive connection is the HTTP layer's business.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

/// A listener whose connections time out writes that stall for `after` (None: never).
pub struct Deadlined {
    pub inner: TcpListener,
    pub after: Option<Duration>,
}

impl axum::serve::Listener for Deadlined {
    type Io = DeadlineIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        let after = self.after;
        (
            DeadlineIo {
                io,
                after,
                timer: None,
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection whose writes fail once they have been blocked for `after`.
pub struct DeadlineIo {
    io: TcpStream,
    after: Option<Duration>,
    /// Armed when a write first blocks; dropped when one makes progress.
    timer: Option<Pin<Box<Sleep>>>,
}

impl DeadlineIo {
    /// `polled` (a write's or flush's outcome) with the deadline applied: progress disarms
    /// it, a block arms it, and a block past it is `TimedOut`.
    fn deadline<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.timer = None;
            return polled;
        }
        let Some(after) = self.after else {
            return Poll::Pending;
        };
        // Planted: the deadline never fires.
        if crate::plant::is(crate::plant::Defect::WriteDeadlineOff) {
            return Poll::Pending;
        }
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(after)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {after:?} (twice --stall-timeout)"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for DeadlineIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for DeadlineIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.deadline(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.deadline(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.deadline(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_shutdown(cx);
        self.deadline(cx, polled)
    }
}
