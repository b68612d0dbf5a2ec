//! Stage 2 on random clusters: it keeps as many running instances as any transition can
//! (checked by enumeration), never uses a GPU twice, keeps TP groups inside a node, and
//! orders actions so that a stop only precedes the launch that needs its GPUs.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::super::inputs::{Deployment, Instance};
use super::super::sequence::Action;
use super::super::solver::SolveSettings;
use super::super::stage2::plan_transition;
use super::{default_solver, Lcg};

const DEGREES: [u32; 3] = [1, 2, 4];

/// Random instances filling part of each node, on random GPUs.
fn random_fill(rng: &mut Lcg, node_gpus: &[u32]) -> Vec<Instance> {
    let mut out = Vec::new();
    for (node, &g) in node_gpus.iter().enumerate() {
        let mut free: Vec<u32> = (0..g).collect();
        for i in (1..free.len()).rev() {
            free.swap(i, (rng.next() * (i + 1) as f64) as usize);
        }
        while rng.next() < 0.8 {
            let fitting: Vec<u32> = DEGREES
                .iter()
                .copied()
                .filter(|&d| d as usize <= free.len())
                .collect();
            if fitting.is_empty() {
                break;
            }
            let d = fitting[(rng.next() * fitting.len() as f64) as usize];
            let mut gpus: Vec<u32> = free.drain(..d as usize).collect();
            gpus.sort_unstable();
            out.push(Instance {
                node,
                degree: d,
                gpus,
            });
        }
    }
    out
}

fn counts(instances: &[Instance]) -> Vec<u32> {
    DEGREES
        .iter()
        .map(|&d| instances.iter().filter(|i| i.degree == d).count() as u32)
        .collect()
}

/// Whether `need[d]` instances of each degree fit into nodes with `free` GPUs.
fn packs(need: &mut [u32], free: &mut [u32]) -> bool {
    let Some(d) = (0..need.len()).rev().find(|&d| need[d] > 0) else {
        return true;
    };
    let size = DEGREES[d];
    let mut tried = BTreeSet::new();
    for n in 0..free.len() {
        if free[n] >= size && tried.insert(free[n]) {
            free[n] -= size;
            need[d] -= 1;
            let ok = packs(need, free);
            need[d] += 1;
            free[n] += size;
            if ok {
                return true;
            }
        }
    }
    false
}

/// Most instances any transition to `targets` keeps, by enumerating kept counts per
/// (node, degree).
fn most_keepable(node_gpus: &[u32], current: &[Instance], targets: &[u32]) -> usize {
    let mut groups: BTreeMap<(usize, usize), u32> = BTreeMap::new();
    for inst in current {
        let d = DEGREES
            .iter()
            .position(|&x| x == inst.degree)
            .expect("known degree");
        *groups.entry((inst.node, d)).or_default() += 1;
    }
    let keys: Vec<(usize, usize)> = groups.keys().copied().collect();
    let mut best = 0;
    let mut kept = vec![0u32; keys.len()];
    loop {
        let mut per_degree = vec![0u32; DEGREES.len()];
        let mut free = node_gpus.to_vec();
        for (i, &(n, d)) in keys.iter().enumerate() {
            per_degree[d] += kept[i];
            free[n] -= kept[i] * DEGREES[d];
        }
        if per_degree.iter().zip(targets).all(|(k, t)| k <= t) {
            let mut need: Vec<u32> = targets
                .iter()
                .zip(&per_degree)
                .map(|(t, k)| t - k)
                .collect();
            if packs(&mut need, &mut free) {
                best = best.max(kept.iter().sum::<u32>() as usize);
            }
        }
        // Next combination (odometer).
        let mut i = 0;
        loop {
            if i == keys.len() {
                return best;
            }
            if kept[i] < groups[&keys[i]] {
                kept[i] += 1;
                break;
            }
            kept[i] = 0;
            i += 1;
        }
    }
}

/// Replays the actions from the current deployment, checking GPU use at every step and
/// that each stop is needed by the next launch (or no launch follows).
fn replay(
    node_gpus: &[u32],
    current: &Deployment,
    actions: &[Action],
) -> BTreeSet<(usize, Vec<u32>)> {
    let mut running: BTreeMap<(usize, u32), String> = BTreeMap::new();
    let mut live: BTreeSet<(usize, Vec<u32>)> = BTreeSet::new();
    for (i, inst) in current.instances.iter().enumerate() {
        for &g in &inst.gpus {
            running.insert((inst.node, g), format!("old {i}"));
        }
        live.insert((inst.node, inst.gpus.clone()));
    }
    for (p, action) in actions.iter().enumerate() {
        match action {
            Action::Stop {
                instance,
                node,
                gpus,
            } => {
                assert_eq!(&current.instances[*instance].gpus, gpus);
                assert!(
                    live.remove(&(*node, gpus.clone())),
                    "stopped twice: {action:?}"
                );
                for g in gpus {
                    running.remove(&(*node, *g));
                }
                if let Some(Action::Launch {
                    node: ln, gpus: lg, ..
                }) = actions[p..]
                    .iter()
                    .find(|a| matches!(a, Action::Launch { .. }))
                {
                    assert!(
                        ln == node && lg.iter().any(|g| gpus.contains(g)),
                        "stop {action:?} precedes a launch on {ln}:{lg:?} that does not need it"
                    );
                }
            }
            Action::Launch { node, degree, gpus } => {
                assert_eq!(gpus.len(), *degree as usize);
                for &g in gpus {
                    assert!(g < node_gpus[*node], "GPU {g} beyond node {node}");
                    assert!(
                        running.insert((*node, g), format!("new {p}")).is_none(),
                        "GPU {node}:{g} used twice"
                    );
                }
                live.insert((*node, gpus.clone()));
            }
        }
    }
    live
}

fn check(seed: u64) {
    let mut rng = Lcg(seed);
    let nodes = 1 + (rng.next() * 3.0) as usize;
    let node_gpus: Vec<u32> = (0..nodes)
        .map(|_| [2, 4, 8][(rng.next() * 3.0) as usize])
        .collect();
    let current = Deployment {
        instances: random_fill(&mut rng, &node_gpus),
        batch_tokens: Default::default(),
    };
    let targets = if rng.next() < 0.2 {
        counts(&current.instances)
    } else {
        counts(&random_fill(&mut rng, &node_gpus))
    };
    // Any placement of the targets serves as the warm-start witness.
    let mut witness = vec![vec![0u32; DEGREES.len()]; nodes];
    let mut free = node_gpus.clone();
    for d in (0..DEGREES.len()).rev() {
        for _ in 0..targets[d] {
            let n = (0..nodes)
                .find(|&n| free[n] >= DEGREES[d])
                .expect("targets pack");
            free[n] -= DEGREES[d];
            witness[n][d] += 1;
        }
    }
    let settings = SolveSettings {
        solver: default_solver(),
        deadline: std::time::Instant::now() + std::time::Duration::from_secs(60),
        mip_gap: 0.0,
    };
    let plan = plan_transition(
        &node_gpus, &DEGREES, &targets, &current, &witness, &settings,
    )
    .expect("transition plans");
    assert_eq!(
        plan.kept.len(),
        most_keepable(&node_gpus, &current.instances, &targets)
    );
    assert_eq!(counts(&plan.instances), targets);
    for &i in &plan.kept {
        assert!(plan.instances.contains(&current.instances[i]));
    }
    if targets == counts(&current.instances) {
        assert_eq!(plan.kept.len(), current.instances.len());
        assert!(plan.actions.is_empty());
    }
    let live = replay(&node_gpus, &current, &plan.actions);
    let expected: BTreeSet<(usize, Vec<u32>)> = plan
        .instances
        .iter()
        .map(|i| (i.node, i.gpus.clone()))
        .collect();
    assert_eq!(live, expected);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn stage2_keeps_every_keepable_instance(seed in any::<u64>()) {
        check(seed);
    }
}
