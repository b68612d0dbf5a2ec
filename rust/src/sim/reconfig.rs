//! Replanning in simulated time: the live engine's replanner (`planner::Replanner`) decides
//! when to plan, what to ask and when a stop hands over; here its adopted plans' Stage-2
//! sequences run one action at a time — a launch is ready after the launch time; a stop
//! drains the instance by migration and removes it once empty (or, by handover, once its
//! running step ends: its requests wait for the launch).

use std::collections::VecDeque;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::cluster::Simulation;
use super::SimError;
use crate::planner::{plan, Action, Arrival, ReplanOptions, Replanner, RunningInstance};
use crate::scheduler::InstanceSpec;

/// The replanner's options and what the simulated cluster adds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimReplanOptions {
    #[serde(flatten)]
    pub replan: ReplanOptions,
    /// Simulated seconds from a launch to the instance serving.
    pub launch_s: f64,
    /// GPUs of each node.
    pub node_gpus: Vec<u32>,
}

/// An action of an adopted plan under way.
#[derive(Clone, Debug)]
enum Running {
    Launch { ready_at: f64, spec: InstanceSpec },
    Stop { id: u64, handover: bool },
}

pub(super) struct Reconfig {
    replanner: Replanner,
    launch_s: f64,
    node_gpus: Vec<u32>,
    queue: VecDeque<Action>,
    /// Instance id of each deployment entry of the adopted plan whose actions are queued.
    plan_ids: Vec<u64>,
    running: Option<Running>,
}

impl Reconfig {
    pub fn new(options: SimReplanOptions) -> Result<Self, SimError> {
        if !(options.launch_s.is_finite() && options.launch_s >= 0.0) {
            return Err(SimError::Cluster(format!(
                "launch time must be finite and non-negative, got {}",
                options.launch_s
            )));
        }
        Ok(Self {
            replanner: Replanner::new(options.replan)?,
            launch_s: options.launch_s,
            node_gpus: options.node_gpus,
            queue: VecDeque::new(),
            plan_ids: Vec::new(),
            running: None,
        })
    }

    pub fn record(&mut self, arrival: Arrival) {
        self.replanner.record(arrival);
    }

    /// The next time this needs the loop: a plan due or a launch ready. A drain in progress
    /// is checked after every event, so it needs no time of its own.
    pub fn next_event(&self) -> f64 {
        match &self.running {
            Some(Running::Launch { ready_at, .. }) => *ready_at,
            _ if self.busy() => f64::INFINITY,
            _ => self.replanner.next_plan(),
        }
    }

    fn busy(&self) -> bool {
        self.running.is_some() || !self.queue.is_empty()
    }

    /// Moves the reconfiguration forward to `now`.
    pub fn advance(&mut self, sim: &mut Simulation<'_>, now: f64) -> Result<(), SimError> {
        if !self.busy() && now >= self.replanner.next_plan() {
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
            let Some(action) = self.queue.pop_front() else {
                return Ok(());
            };
            self.start(sim, now, action)?;
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
    ) -> Result<(), SimError> {
        self.running = Some(match action {
            Action::Launch { node, degree, gpus } => {
                let id = sim.instances.keys().max().map_or(0, |m| m + 1);
                let id = id.max(sim.sched.instance_ids().iter().max().map_or(0, |m| m + 1));
                Running::Launch {
                    ready_at: now + self.launch_s,
                    spec: InstanceSpec::new(id, degree, gpus, node as u32),
                }
            }
            Action::Stop { instance, .. } => {
                let id = self.plan_ids[instance];
                let others_serve = sim.instances.keys().any(|&i| i != id);
                let launch_follows = self
                    .queue
                    .iter()
                    .any(|a| matches!(a, Action::Launch { .. }));
                let handover = Replanner::handover(others_serve, launch_follows);
                if !handover {
                    sim.sched.drain_instance(id)?;
                }
                Running::Stop { id, handover }
            }
        });
        Ok(())
    }

    fn replan(&mut self, sim: &mut Simulation<'_>, now: f64) -> Result<(), SimError> {
        let running: Vec<RunningInstance> = sim
            .instances
            .values()
            .map(|i| RunningInstance {
                id: i.spec.id,
                node: i.spec.node as usize,
                degree: i.spec.tp,
                gpus: i.spec.gpus.clone(),
            })
            .collect();
        let default_batch = sim.sched.config().max_batch_tokens;
        let Some(asked) = self.replanner.inputs(
            now,
            None,
            &running,
            &self.node_gpus,
            default_batch,
            sim.sched.profile(),
        )?
        else {
            return Ok(());
        };
        let started = Instant::now();
        let result = plan(&asked.inputs, sim.sched.profile())?;
        sim.stats.plan_seconds += started.elapsed().as_secs_f64();
        sim.stats.replans += 1;
        self.replanner.adopt(&result);
        if let (true, Some(transition)) = (result.adopted, result.transition) {
            sim.stats.plans_adopted += 1;
            self.plan_ids = asked.instance_ids;
            self.queue.extend(transition.actions);
        }
        Ok(())
    }
}
