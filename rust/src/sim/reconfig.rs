//! Periodic replanning in simulated time (DESIGN §7), as the live engine's reconfigurer
//! does it: plan for the last window's arrivals and, when the planner adopts the plan,
//! execute its Stage-2 sequence one action at a time — a launch is ready after the launch
//! time; a stop drains the instance by migration and removes it once empty (or, when it is
//! the last one serving and a launch follows, once its running step ends: its requests
//! wait for the launch). The running deployment is described to the planner with each
//! degree's batch size of the last adopted plan, as live; instances keep the scheduler's
//! batch-token budget.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::cluster::Simulation;
use super::SimError;
use crate::planner::{
    classes_from_arrivals, plan, Action, Arrival, BinSpec, Deployment, Instance, PlannerConfig,
    PlannerInputs, ThresholdOption,
};
use crate::scheduler::InstanceSpec;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplanOptions {
    /// Simulated seconds between planner runs (the paper: 300).
    pub interval_s: f64,
    /// Arrivals of this many past seconds make the planner's request classes.
    pub window_s: f64,
    /// Simulated seconds from a launch to the instance serving.
    pub launch_s: f64,
    /// GPUs of each node.
    pub node_gpus: Vec<u32>,
    pub planner: PlannerConfig,
    pub thresholds: Vec<ThresholdOption>,
    #[serde(default)]
    pub bins: BinSpec,
}

/// An action of an adopted plan under way.
#[derive(Clone, Debug)]
enum Running {
    Launch { ready_at: f64, spec: InstanceSpec },
    Stop { id: u64, handover: bool },
}

pub(super) struct Reconfig {
    options: ReplanOptions,
    next_plan: f64,
    recent: VecDeque<Arrival>,
    queue: VecDeque<(Action, Vec<u64>)>,
    running: Option<Running>,
    /// Batch tokens per TP degree of the last adopted plan (until one: the scheduler's
    /// budget), which describe the running deployment to the next plan.
    batch_tokens: BTreeMap<u32, u64>,
}

impl Reconfig {
    pub fn new(options: ReplanOptions) -> Result<Self, SimError> {
        for (name, v) in [
            ("interval", options.interval_s),
            ("window", options.window_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(SimError::Cluster(format!(
                    "replan {name} must be positive and finite, got {v}"
                )));
            }
        }
        if !(options.launch_s.is_finite() && options.launch_s >= 0.0) {
            return Err(SimError::Cluster(format!(
                "launch time must be finite and non-negative, got {}",
                options.launch_s
            )));
        }
        Ok(Self {
            next_plan: options.interval_s,
            options,
            recent: VecDeque::new(),
            queue: VecDeque::new(),
            running: None,
            batch_tokens: BTreeMap::new(),
        })
    }

    pub fn record(&mut self, arrival: Arrival) {
        self.recent.push_back(arrival);
    }

    /// The next time this needs the loop: a plan due or a launch ready. A drain in progress
    /// is checked after every event, so it needs no time of its own.
    pub fn next_event(&self) -> f64 {
        match &self.running {
            Some(Running::Launch { ready_at, .. }) => *ready_at,
            _ if self.busy() => f64::INFINITY,
            _ => self.next_plan,
        }
    }

    fn busy(&self) -> bool {
        self.running.is_some() || !self.queue.is_empty()
    }

    /// Moves the reconfiguration forward to `now`.
    pub fn advance(&mut self, sim: &mut Simulation<'_>, now: f64) -> Result<(), SimError> {
        if !self.busy() && now >= self.next_plan {
            self.next_plan = now + self.options.interval_s;
            self.replan(sim, now)?;
        }
        loop {
            match self.running.take() {
                Some(Running::Launch { ready_at, spec }) if ready_at <= now => {
                    sim.add_instance(spec)?;
                    sim.stats.launches += 1;
                }
                Some(Running::Stop { id, handover }) if self.stopped(sim, id, handover) => {
                    sim.sched.remove_instance(id)?;
                    sim.instances.remove(&id);
                    sim.stats.stops += 1;
                }
                Some(still) => {
                    self.running = Some(still);
                    return Ok(());
                }
                None => {}
            }
            let Some((action, ids)) = self.queue.pop_front() else {
                return Ok(());
            };
            self.start(sim, now, action, &ids)?;
        }
    }

    fn stopped(&self, sim: &Simulation<'_>, id: u64, handover: bool) -> bool {
        if handover {
            !sim.busy(id)
        } else {
            !sim.busy(id) && sim.sched.drained_instances().contains(&id)
        }
    }

    fn start(
        &mut self,
        sim: &mut Simulation<'_>,
        now: f64,
        action: Action,
        ids: &[u64],
    ) -> Result<(), SimError> {
        self.running = Some(match action {
            Action::Launch { node, degree, gpus } => {
                let id = sim.instances.keys().max().map_or(0, |m| m + 1);
                let id = id.max(sim.sched.instance_ids().iter().max().map_or(0, |m| m + 1));
                Running::Launch {
                    ready_at: now + self.options.launch_s,
                    spec: InstanceSpec::new(id, degree, gpus, node as u32),
                }
            }
            Action::Stop { instance, .. } => {
                let id = ids[instance];
                let others_serve = sim.instances.keys().any(|&i| i != id);
                let launch_follows = self
                    .queue
                    .iter()
                    .any(|(a, _)| matches!(a, Action::Launch { .. }));
                let handover = !others_serve && launch_follows;
                if !handover {
                    sim.sched.drain_instance(id)?;
                }
                Running::Stop { id, handover }
            }
        });
        Ok(())
    }

    fn replan(&mut self, sim: &mut Simulation<'_>, now: f64) -> Result<(), SimError> {
        let start = now - self.options.window_s;
        while self.recent.front().is_some_and(|a| a.time < start) {
            self.recent.pop_front();
        }
        if self.recent.is_empty() {
            return Ok(());
        }
        let arrivals: Vec<Arrival> = self.recent.iter().cloned().collect();
        let mut running: Vec<&InstanceSpec> = sim.instances.values().map(|i| &i.spec).collect();
        running.sort_by_key(|s| s.id);
        let ids: Vec<u64> = running.iter().map(|s| s.id).collect();
        let config: &PlannerConfig = &self.options.planner;
        let default_batch = sim.sched.config().max_batch_tokens;
        let batch = |degree: u32| *self.batch_tokens.get(&degree).unwrap_or(&default_batch);
        let current = Deployment {
            instances: running
                .iter()
                .map(|s| Instance {
                    node: s.node as usize,
                    degree: s.tp,
                    gpus: s.gpus.clone(),
                })
                .collect(),
            batch_tokens: running.iter().map(|s| (s.tp, batch(s.tp))).collect(),
        };
        let inputs = PlannerInputs {
            classes: classes_from_arrivals(&arrivals, start, now, &self.options.bins)?,
            thresholds: self.options.thresholds.clone(),
            node_gpus: self.options.node_gpus.clone(),
            config: config.clone(),
            current: Some(current),
        };
        let started = Instant::now();
        let result = plan(&inputs, sim.sched.profile())?;
        sim.stats.plan_seconds += started.elapsed().as_secs_f64();
        sim.stats.replans += 1;
        if let (true, Some(transition)) = (result.adopted, result.transition) {
            sim.stats.plans_adopted += 1;
            self.batch_tokens.extend(
                result
                    .capacity
                    .degrees
                    .iter()
                    .filter_map(|d| Some((d.degree, d.batch_tokens?))),
            );
            self.queue
                .extend(transition.actions.into_iter().map(|a| (a, ids.clone())));
        }
        Ok(())
    }
}
