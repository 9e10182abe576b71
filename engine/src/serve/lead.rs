//! Rank 0's side of `engine serve` under a group: the worker shares each admission, keeps
//! the idle heartbeat, and treats a failed step as the group lost (`dist_plan` holds the
//! plans and their framing; `follower` the other ranks' loop).

use mlx_rs::error::Exception;

use super::dist_plan::{Admit, Leader, Op, HEARTBEAT};
use super::error::ApiError;
use super::worker::{Job, Worker};

impl Worker {
    /// An MLX error of a model step as the request's error; under a group it also marks
    /// the group lost (the step held collectives: the ranks no longer agree).
    pub(super) fn model_error(&self, e: Exception) -> ApiError {
        match &self.dist {
            Some(lead) if !super::dist_plan::same_on_every_rank(e.what()) => lead.lose(&e),
            _ => e.into(),
        }
    }

    /// A panic on the model thread as the request's error (and, under a group, the group
    /// lost).
    pub(super) fn lose_on_panic(&self, panic: Box<dyn std::any::Any + Send>) -> ApiError {
        let e = super::worker::panic_error(panic);
        match &self.dist {
            Some(lead) => lead.lose(&e.message),
            None => e,
        }
    }

    /// Under a group, shares an admission before its prefill; its id (0 outside a group).
    pub(super) fn share_admission(
        &self,
        request: &super::request::GenRequest,
        prompt: &[u32],
        max_tokens: usize,
        cached: usize,
    ) -> Result<u64, ApiError> {
        let Some(lead) = &self.dist else { return Ok(0) };
        let id = lead.next_id();
        let admit = Admit {
            id,
            prompt: prompt.to_vec(),
            max_tokens,
            sampling: (&request.sampling).into(),
            cached,
            constraint: request.constraint.clone(),
        };
        lead.send(Some(Op::Admit(Box::new(admit))))
            .map_err(|e| lead.lose(&e))?;
        Ok(id)
    }

    /// Rank 0 waiting for a job: an empty plan every [`HEARTBEAT`]; when every sender is
    /// gone, shutdown is shared and None returned.
    pub(super) fn lead_idle(
        &self,
        lead: &Leader,
        jobs: &std::sync::mpsc::Receiver<super::worker::Work>,
    ) -> Option<Job> {
        use std::sync::mpsc::RecvTimeoutError;
        loop {
            let sent = match jobs.recv_timeout(HEARTBEAT) {
                Ok(work) => match self.divert(work) {
                    Some(job) => return Some(job),
                    None => continue,
                },
                Err(RecvTimeoutError::Timeout) => lead.heartbeat(),
                Err(RecvTimeoutError::Disconnected) => {
                    // Followers end on this plan: their hang-ups are expected from here.
                    crate::dist::done();
                    if let Err(e) = lead.send(Some(Op::Shutdown)) {
                        crate::dist::fatal(&e)
                    }
                    return None;
                }
            };
            if let Err(e) = sent {
                // Nothing is in flight: the server exits at once.
                crate::dist::fatal(&e)
            }
        }
    }
}
