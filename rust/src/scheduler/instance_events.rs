//! Instance events: announcing, draining, removing an instance, and a step that failed on
//! one. Each checks its input before changing anything.

use super::config::Prediction;
use super::cost::DegreeCosts;
use super::decisions::MigrationReason;
use super::error::SchedError;
use super::instance::InstanceSpec;
use super::Scheduler;
use crate::profile::StepKind;

impl Scheduler {
    /// Announces a new instance; it takes requests from the next round.
    pub fn add_instance(&mut self, spec: InstanceSpec) -> Result<(), SchedError> {
        self.instances.validate(&spec)?;
        let group = match self.groups.iter().position(|g| g.tp == spec.tp) {
            Some(group) => group,
            None => {
                let costs = DegreeCosts::new(
                    &self.profile,
                    spec.tp,
                    self.config.caching,
                    self.config.max_batch_tokens,
                )?
                .exact(self.config.exact_cache);
                self.groups.push(costs);
                self.group_factors.push(1.0);
                self.groups.len() - 1
            }
        };
        self.instances
            .insert(spec, group, self.config.max_batch_tokens);
        Ok(())
    }

    /// Stops sending new requests to an instance. Requests it holds finish their current
    /// block there (with caching) and then move; once it is idle and holds none it is
    /// listed by [`Scheduler::drained_instances`] and the caller may remove it.
    pub fn drain_instance(&mut self, id: u64) -> Result<(), SchedError> {
        let slot = self.instances.slot_of(id)?;
        self.instances.slots[slot as usize].draining = true;
        if self.reservation.is_some_and(|v| v.slot == slot) {
            self.reservation = None;
        }
        Ok(())
    }

    /// Lets a draining instance take requests again.
    pub fn undrain_instance(&mut self, id: u64) -> Result<(), SchedError> {
        let slot = self.instances.slot_of(id)?;
        self.instances.slots[slot as usize].draining = false;
        Ok(())
    }

    /// Ids of draining instances that are idle and hold no request: safe to stop.
    pub fn drained_instances(&self) -> Vec<u64> {
        self.instances
            .slots
            .iter()
            .filter(|i| i.alive && i.draining && !i.busy && i.residents == 0)
            .map(|i| i.id)
            .collect()
    }

    /// Forgets an instance (stopped or failed). Its requests, including those of a step in
    /// flight, lose their cache and are placed again from the engine's copy of their state.
    pub fn remove_instance(&mut self, id: u64) -> Result<(), SchedError> {
        let inst_slot = self.instances.slot_of(id)?;
        let inst = &mut self.instances.slots[inst_slot as usize];
        inst.clear_steps();
        self.instances.remove(inst_slot);
        if self.reservation.is_some_and(|v| v.slot == inst_slot) {
            self.reservation = None;
        }
        self.scratch.pending.clear();
        for pos in 0..self.requests.len() as u32 {
            let r = self.requests.req(pos);
            if r.alive && r.home == Some(inst_slot) {
                self.displace(pos, id, MigrationReason::InstanceRemoved);
            }
        }
        self.refresh_predictions()?;
        Ok(())
    }

    /// The step in flight on `instance` failed (the send failed, the worker died, it ran out
    /// of memory), and with it the step queued behind it, if any (it followed from the
    /// failed one). The instance becomes idle; the requests of those steps are ready again
    /// with no progress counted and hold no state there any more: with caching their next
    /// step recomputes, and a move elsewhere is reported as a `StepAborted` migration.
    /// Returns the ids of those requests (cancelled ones excluded).
    pub fn abort_step(&mut self, instance: u64) -> Result<&[u64], SchedError> {
        let inst_slot = self.instances.slot_of(instance)?;
        let inst = &mut self.instances.slots[inst_slot as usize];
        if !inst.busy {
            return Err(SchedError::NoStepInFlight(instance));
        }
        let mut handles = std::mem::take(&mut inst.inflight);
        for handle in inst.ahead.take().map(|a| a.handles).unwrap_or_default() {
            if !handles.contains(&handle) {
                handles.push(handle);
            }
        }
        inst.clear_steps();
        self.scratch.aborted.clear();
        self.scratch.pending.clear();
        for &handle in &handles {
            let pos = self.requests.pos_of_handle(handle);
            let r = *self.requests.req(pos);
            self.instances.slots[inst_slot as usize].drop_resident(&r);
            self.displace(pos, instance, MigrationReason::StepAborted);
            self.scratch.aborted.push(r.id);
        }
        // Keep the buffer's capacity for the next step.
        let inst = &mut self.instances.slots[inst_slot as usize];
        inst.inflight = handles;
        inst.inflight.clear();
        self.refresh_predictions()?;
        Ok(&self.scratch.aborted)
    }

    /// Detaches request `pos` from its instance `from`: it is ready, holds no cache, and its
    /// next dispatch elsewhere is reported as a migration for `reason`. Queues a fresh
    /// prediction in `scratch.pending` when the lost cache changes its next step.
    fn displace(&mut self, pos: u32, from: u64, reason: MigrationReason) {
        let caching = self.config.caching;
        let online = self.config.policy.prediction == Prediction::Online;
        self.requests.set_ready(pos, true);
        let r = self.requests.req_mut(pos);
        r.home = None;
        r.displaced_from = Some((from, reason));
        r.ahead_tau = None;
        if caching && r.next_kind == StepKind::Cache {
            r.next_kind = StepKind::Recompute;
            if online {
                self.scratch.pending.push(pos);
            }
        }
    }
}
