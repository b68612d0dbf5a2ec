//! Replanning in simulated time: the live engine's replanner (`planner::Replanner`) decides
//! when to plan, what to ask and when a stop hands over; here its adopted plans' Stage-2
//! sequences run one action at a time — a launch is ready after the launch time; a stop
//! drains the instance by migration and removes it once empty (or, by handover, once its
//! running step ends: its requests wait for the launch).
//!
//! *(ours)* Before a plan is adopted it is rehearsed: the window's requests are replayed
//! twice on fresh copies of the cluster, once staying and once moving by the plan's own
//! transition (each launch unavailable for the launch time, stops draining), and the plan
//! is adopted only if moving meets more deadlines by `REHEARSAL_MARGIN`. The planner's
//! model prices steps at planned batch sizes and ignores the transition; the rehearsal
//! prices both as the scheduler will run them, so a plan whose gain does not survive its
//! transition, or that only looks better to the planner, is not adopted. A cluster of more
//! than `REHEARSAL_MAX_INSTANCES` instances is rehearsed on a slice of it: the nodes the
//! plan touches first, then others, until they hold that many instances; every k-th request
//! of the window for their share of the GPUs; and the plan's actions on them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::cluster::Simulation;
use super::{SimError, SimRequest};
use crate::planner::{plan, Action, Arrival, ReplanOptions, Replanner, RunningInstance};
use crate::scheduler::{InstanceSpec, MeanRatePredictor, Scheduler};

/// Share of the window's requests a rehearsed plan must meet beyond staying to be adopted.
pub const REHEARSAL_MARGIN: f64 = 0.005;

/// Most instances a rehearsal replays: a larger cluster is rehearsed on a slice of its
/// nodes with the same share of the window's requests, so that rehearsing a plan at 1,024
/// GPUs costs about what it does at 64 (the whole cluster took 100 s a plan there).
pub const REHEARSAL_MAX_INSTANCES: usize = 64;

fn yes() -> bool {
    true
}

/// The replanner's options and what the simulated cluster adds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimReplanOptions {
    #[serde(flatten)]
    pub replan: ReplanOptions,
    /// Simulated seconds from a launch to the instance serving.
    pub launch_s: f64,
    /// GPUs of each node.
    pub node_gpus: Vec<u32>,
    /// Rehearse each plan on the window's requests before adopting it (off: the planner's
    /// adoption rule alone).
    #[serde(default = "yes")]
    pub rehearse: bool,
}

/// An action of an adopted plan under way.
#[derive(Clone, Debug)]
enum Running {
    Launch { ready_at: f64, spec: InstanceSpec },
    Stop { id: u64, handover: bool },
}

pub(super) struct Reconfig {
    /// `None` in a rehearsal: it runs one given transition and never plans.
    replanner: Option<Replanner>,
    launch_s: f64,
    node_gpus: Vec<u32>,
    rehearse: bool,
    /// The window's requests as they arrived, for rehearsals.
    recent: VecDeque<SimRequest>,
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
            replanner: Some(Replanner::new(options.replan)?),
            launch_s: options.launch_s,
            node_gpus: options.node_gpus,
            rehearse: options.rehearse,
            recent: VecDeque::new(),
            queue: VecDeque::new(),
            plan_ids: Vec::new(),
            running: None,
        })
    }

    /// A reconfiguration that runs `actions` (a plan's transition; `ids`: the instance of
    /// each of its deployment entries) from the start and never plans.
    fn scripted(actions: &[Action], ids: &[u64], launch_s: f64) -> Self {
        Self {
            replanner: None,
            launch_s,
            node_gpus: Vec::new(),
            rehearse: false,
            recent: VecDeque::new(),
            queue: actions.iter().cloned().collect(),
            plan_ids: ids.to_vec(),
            running: None,
        }
    }

    pub fn record(&mut self, request: &SimRequest) {
        let Some(replanner) = &mut self.replanner else {
            return;
        };
        replanner.record(Arrival {
            time: request.arrival,
            prompt_tokens: u64::from(request.prompt_len),
            output_tokens: u64::from(request.output_len),
        });
        if self.rehearse {
            let horizon = request.arrival - replanner.options().window_s;
            while self.recent.front().is_some_and(|r| r.arrival < horizon) {
                self.recent.pop_front();
            }
            self.recent.push_back(*request);
        }
    }

    /// The next time this needs the loop: a plan due or a launch ready. A drain in progress
    /// is checked after every event, so it needs no time of its own.
    pub fn next_event(&self) -> f64 {
        match &self.running {
            Some(Running::Launch { ready_at, .. }) => *ready_at,
            _ if self.busy() => f64::INFINITY,
            _ => self
                .replanner
                .as_ref()
                .map_or(f64::INFINITY, Replanner::next_plan),
        }
    }

    fn busy(&self) -> bool {
        self.running.is_some() || !self.queue.is_empty()
    }

    /// Moves the reconfiguration forward to `now`.
    pub fn advance(&mut self, sim: &mut Simulation<'_>, now: f64) -> Result<(), SimError> {
        let due = self
            .replanner
            .as_ref()
            .is_some_and(|r| now >= r.next_plan());
        if !self.busy() && due {
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
        let Some(replanner) = &mut self.replanner else {
            return Ok(());
        };
        let Some(asked) = replanner.inputs(
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
        let window_s = replanner.options().window_s;
        let (true, Some(transition)) = (result.adopted, &result.transition) else {
            replanner.adopt(&result);
            return Ok(());
        };
        if self.rehearse && !transition.actions.is_empty() {
            let started = Instant::now();
            let (nodes, share) = rehearsal_slice(sim, &self.node_gpus, &transition.actions);
            let requests = thinned(self.window(now - window_s), share);
            let on_slice: Vec<Action> = transition
                .actions
                .iter()
                .filter(|a| nodes.contains(&action_node(a)))
                .cloned()
                .collect();
            let stay = rehearse(sim, &nodes, &requests, None)?;
            let script = Self::scripted(&on_slice, &asked.instance_ids, self.launch_s);
            let moved = rehearse(sim, &nodes, &requests, Some(script))?;
            sim.stats.rehearsal_seconds += started.elapsed().as_secs_f64();
            if moved < stay + REHEARSAL_MARGIN {
                sim.stats.plans_rehearsed_out += 1;
                return Ok(());
            }
        }
        if let Some(replanner) = &mut self.replanner {
            replanner.adopt(&result);
        }
        sim.stats.plans_adopted += 1;
        self.plan_ids = asked.instance_ids;
        self.queue.extend(transition.actions.iter().cloned());
        Ok(())
    }

    /// The requests that arrived since `start`, arriving from time 0 on.
    fn window(&self, start: f64) -> Vec<SimRequest> {
        self.recent
            .iter()
            .filter(|r| r.arrival >= start)
            .map(|r| SimRequest {
                arrival: r.arrival - start,
                ..*r
            })
            .collect()
    }
}

fn action_node(action: &Action) -> u32 {
    match action {
        Action::Launch { node, .. } | Action::Stop { node, .. } => *node as u32,
    }
}

/// The nodes a rehearsal replays and their share of the cluster's GPUs: every node while
/// the cluster runs at most `REHEARSAL_MAX_INSTANCES` instances; beyond that, the nodes
/// the plan's `actions` touch, then the others, in node order, until they hold that many
/// (a transition's actions on one node launch on the GPUs its stops there free, so the
/// actions of whole nodes are a transition of their own).
fn rehearsal_slice(
    sim: &Simulation<'_>,
    node_gpus: &[u32],
    actions: &[Action],
) -> (BTreeSet<u32>, f64) {
    let every: BTreeSet<u32> = (0..node_gpus.len() as u32).collect();
    if sim.instances.len() <= REHEARSAL_MAX_INSTANCES {
        return (every, 1.0);
    }
    let mut per_node: BTreeMap<u32, usize> = BTreeMap::new();
    for i in sim.instances.values() {
        *per_node.entry(i.spec.node).or_default() += 1;
    }
    let touched: BTreeSet<u32> = actions.iter().map(action_node).collect();
    let rest = every.iter().filter(|n| !touched.contains(n));
    let (mut nodes, mut kept) = (BTreeSet::new(), 0);
    for &node in touched.iter().chain(rest) {
        if kept >= REHEARSAL_MAX_INSTANCES {
            break;
        }
        nodes.insert(node);
        kept += per_node.get(&node).copied().unwrap_or(0);
    }
    let gpus = |n: &u32| f64::from(node_gpus.get(*n as usize).copied().unwrap_or(0));
    let total: f64 = every.iter().map(gpus).sum();
    let share = nodes.iter().map(gpus).sum::<f64>() / total.max(1.0);
    (nodes, share)
}

/// Every k-th of `requests` for a `share` of them (all for 1).
fn thinned(requests: Vec<SimRequest>, share: f64) -> Vec<SimRequest> {
    if share >= 1.0 {
        return requests;
    }
    let taken = |j: usize| (j as f64 * share).floor();
    requests
        .into_iter()
        .enumerate()
        .filter(|&(j, _)| taken(j + 1) > taken(j))
        .map(|(_, r)| r)
        .collect()
}

/// Share of `requests` that meet their deadlines on a fresh copy of `sim`'s instances on
/// `nodes` and its scheduler settings, running `script` (a transition) from the start when
/// given. Steps are predicted by the progress model's mean rates and drawn with a fixed
/// seed, so the two rehearsals of a plan see the same draws.
fn rehearse(
    sim: &Simulation<'_>,
    nodes: &BTreeSet<u32>,
    requests: &[SimRequest],
    script: Option<Reconfig>,
) -> Result<f64, SimError> {
    if requests.is_empty() {
        return Ok(1.0);
    }
    let predictor = MeanRatePredictor::new(&sim.progress_models()[0].mean_rates())?;
    let mut sched = Scheduler::with_predictor(
        sim.sched.profile().clone(),
        sim.sched.config().clone(),
        Box::new(predictor),
    )?;
    let mut instances: Vec<InstanceSpec> = sim
        .instances
        .values()
        .filter(|i| nodes.contains(&i.spec.node))
        .map(|i| i.spec.clone())
        .collect();
    instances.sort_by_key(|i| i.id);
    let mut rehearsal = Simulation::new(
        &mut sched,
        &instances,
        requests,
        sim.progress_models(),
        &sim.options(),
    )?;
    rehearsal.set_reconfig(script);
    let result = rehearsal.run()?;
    let met = result.requests.iter().filter(|o| o.slo_met()).count();
    Ok(met as f64 / requests.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thinned_window_keeps_its_share_spread_over_the_window() {
        let requests: Vec<SimRequest> = (0..1000)
            .map(|i| SimRequest {
                arrival: f64::from(i),
                prompt_len: 10,
                output_len: 10,
                slo_s: 1.0,
                class: 0,
            })
            .collect();
        let kept = thinned(requests.clone(), 0.25);
        assert_eq!(kept.len(), 250);
        assert!(kept.windows(2).all(|w| w[1].arrival - w[0].arrival == 4.0));
        assert_eq!(thinned(requests.clone(), 1.0), requests);
    }
}
