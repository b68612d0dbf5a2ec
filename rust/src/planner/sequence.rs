//! Launch/stop ordering of a transition: GPUs for every new instance, and an order in which
//! an old instance stops only when a launch needs its GPUs, so serving capacity dips as
//! little and as late as possible.
//!
//! Launches that fit on idle GPUs go first. A launch that needs more GPUs stops just the
//! old instances it needs (their requests migrate first), right before it starts; a launch
//! on GPUs an earlier stop freed follows that stop. Old instances no launch needs are not
//! in the target and stop last.

use serde::{Deserialize, Serialize};

use super::inputs::{Deployment, Instance};

/// One step of a transition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Migrate the requests of current instance `instance` elsewhere, then stop it.
    Stop {
        instance: usize,
        node: usize,
        gpus: Vec<u32>,
    },
    /// Start a new TP group on these GPUs of `node`.
    Launch {
        node: usize,
        degree: u32,
        gpus: Vec<u32>,
    },
}

/// A launch and the old instances it has to stop first.
struct Step {
    launch: Instance,
    stops: Vec<usize>,
    /// Whether all its GPUs were idle before the transition (so it may go first).
    on_idle_gpus: bool,
}

/// Picks released instances to stop until `needed` GPUs are free: the smallest single
/// instance that covers the gap, else the largest and repeat.
fn pick_stops(released: &mut Vec<usize>, current: &Deployment, mut missing: usize) -> Vec<usize> {
    let mut stops = Vec::new();
    while missing > 0 && !released.is_empty() {
        let size = |i: usize| current.instances[i].gpus.len();
        let covering = released
            .iter()
            .enumerate()
            .filter(|&(_, &i)| size(i) >= missing)
            .min_by_key(|&(_, &i)| (size(i), i));
        let pos = match covering {
            Some((pos, _)) => pos,
            None => (0..released.len())
                .max_by_key(|&p| (size(released[p]), std::cmp::Reverse(released[p])))
                .unwrap_or(0),
        };
        let i = released.remove(pos);
        missing = missing.saturating_sub(size(i));
        stops.push(i);
    }
    stops
}

/// Per node: GPUs for each new instance and the stops each launch needs; returns the
/// steps and the released instances no launch needed.
fn node_steps(
    node: usize,
    gpus: u32,
    current: &Deployment,
    keep: &[bool],
    degrees: &[u32],
) -> (Vec<Step>, Vec<usize>) {
    let mut busy = vec![false; gpus as usize];
    let mut released = Vec::new();
    for (i, inst) in current.instances.iter().enumerate() {
        if inst.node == node {
            for &g in &inst.gpus {
                busy[g as usize] = true;
            }
            if !keep[i] {
                released.push(i);
            }
        }
    }
    let mut free: Vec<u32> = (0..gpus).filter(|&g| !busy[g as usize]).collect();
    let idle = free.clone();
    let mut order = degrees.to_vec();
    order.sort_unstable_by(|a, b| b.cmp(a));
    let mut steps = Vec::with_capacity(order.len());
    for degree in order {
        let missing = (degree as usize).saturating_sub(free.len());
        let stops = pick_stops(&mut released, current, missing);
        // The GPUs just stopped go first, so every stop serves this launch.
        let mut pool: Vec<u32> = stops
            .iter()
            .flat_map(|&i| current.instances[i].gpus.iter().copied())
            .collect();
        pool.sort_unstable();
        pool.extend(free.iter().copied());
        let take = (degree as usize).min(pool.len());
        let launch_gpus: Vec<u32> = pool.drain(..take).collect();
        free = pool;
        free.sort_unstable();
        steps.push(Step {
            on_idle_gpus: launch_gpus.iter().all(|g| idle.contains(g)),
            launch: Instance {
                node,
                degree,
                gpus: launch_gpus,
            },
            stops,
        });
    }
    (steps, released)
}

fn stop(current: &Deployment, i: usize) -> Action {
    Action::Stop {
        instance: i,
        node: current.instances[i].node,
        gpus: current.instances[i].gpus.clone(),
    }
}

/// Orders a transition: `keep[i]` marks current instances that stay, `launch[n]` lists
/// the degrees of new instances on node `n`. Returns the launched instances and the actions.
pub(crate) fn sequence(
    node_gpus: &[u32],
    current: &Deployment,
    keep: &[bool],
    launch: &[Vec<u32>],
) -> (Vec<Instance>, Vec<Action>) {
    let mut free_launches = Vec::new();
    let mut stop_launches = Vec::new();
    let mut unneeded = Vec::new();
    for (node, &gpus) in node_gpus.iter().enumerate() {
        let (steps, released) = node_steps(node, gpus, current, keep, &launch[node]);
        // Launches on GPUs some stop frees keep their node's order, after that stop.
        for step in steps {
            if step.on_idle_gpus {
                free_launches.push(step);
            } else {
                stop_launches.push(step);
            }
        }
        unneeded.extend(released);
    }
    let mut launched = Vec::new();
    let mut actions = Vec::new();
    for step in free_launches.into_iter().chain(stop_launches) {
        actions.extend(step.stops.iter().map(|&i| stop(current, i)));
        actions.push(Action::Launch {
            node: step.launch.node,
            degree: step.launch.degree,
            gpus: step.launch.gpus.clone(),
        });
        launched.push(step.launch);
    }
    unneeded.sort_unstable();
    actions.extend(unneeded.into_iter().map(|i| stop(current, i)));
    (launched, actions)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(node: usize, gpus: &[u32]) -> Instance {
        Instance {
            node,
            degree: gpus.len() as u32,
            gpus: gpus.to_vec(),
        }
    }

    #[test]
    fn idle_gpus_launch_first_and_stops_precede_their_launch() {
        let current = Deployment {
            instances: vec![inst(0, &[0]), inst(0, &[1]), inst(0, &[2, 3])],
            batch_tokens: Default::default(),
        };
        // Keep the TP-2, replace the two TP-1s by one TP-2; node 1 (idle) gets a TP-4.
        let (launched, actions) = sequence(
            &[4, 4],
            &current,
            &[false, false, true],
            &[vec![2], vec![4]],
        );
        assert_eq!(launched.len(), 2);
        assert_eq!(
            actions,
            vec![
                Action::Launch {
                    node: 1,
                    degree: 4,
                    gpus: vec![0, 1, 2, 3]
                },
                Action::Stop {
                    instance: 0,
                    node: 0,
                    gpus: vec![0]
                },
                Action::Stop {
                    instance: 1,
                    node: 0,
                    gpus: vec![1]
                },
                Action::Launch {
                    node: 0,
                    degree: 2,
                    gpus: vec![0, 1]
                },
            ]
        );
    }

    #[test]
    fn instances_no_launch_needs_stop_last() {
        let current = Deployment {
            instances: vec![inst(0, &[0, 1]), inst(0, &[2, 3])],
            batch_tokens: Default::default(),
        };
        let (_, actions) = sequence(&[4], &current, &[true, false], &[vec![]]);
        assert_eq!(
            actions,
            vec![Action::Stop {
                instance: 1,
                node: 0,
                gpus: vec![2, 3]
            }]
        );
    }

    #[test]
    fn a_launch_stops_the_smallest_instance_that_frees_enough() {
        let current = Deployment {
            instances: vec![
                inst(0, &[0]),
                inst(0, &[1]),
                inst(0, &[2, 3]),
                inst(0, &[4, 5, 6, 7]),
            ],
            batch_tokens: Default::default(),
        };
        let (launched, actions) = sequence(&[8], &current, &[true, true, false, false], &[vec![2]]);
        assert_eq!(launched[0].gpus, vec![2, 3]);
        assert_eq!(
            actions[0],
            Action::Stop {
                instance: 2,
                node: 0,
                gpus: vec![2, 3]
            }
        );
        assert_eq!(
            actions.last(),
            Some(&Action::Stop {
                instance: 3,
                node: 0,
                gpus: vec![4, 5, 6, 7]
            })
        );
    }
}
