//! How many instances of each TP degree the nodes can hold, stated without node symmetry.
//!
//! Nodes with the same GPU count are interchangeable, so the capacity plan never names a
//! node: per node type it either pools the GPUs (exact when the degrees that fit form a
//! divisibility chain dividing the node size, as 1/2/4/8 on 4- or 8-GPU nodes do) or
//! counts how many nodes use each maximal layout (a multiset of degrees filling a node).
//! Either way one integer point is one placement up to node relabelling, so branch and
//! bound never revisits a permutation of the same nodes.

use super::error::PlannerError;

/// Most layouts enumerated for one node type; beyond this the degree set is unusual enough
/// that the caller should narrow it.
const MAX_LAYOUTS: usize = 10_000;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Packing {
    /// Any instance counts whose GPUs fit in the type's total fit on its nodes.
    Pooled,
    /// Maximal layouts, each as instances per fitting degree (same order as `degrees`).
    Layouts(Vec<Vec<u32>>),
}

/// Nodes sharing a GPU count.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct NodeType {
    pub gpus: u32,
    pub nodes: Vec<usize>,
    /// Indices into the problem's degrees of those that fit on this node size.
    pub degrees: Vec<usize>,
    pub packing: Packing,
}

impl NodeType {
    /// Most instances of the `k`-th fitting degree the type can hold.
    pub fn max_instances(&self, degree: u32) -> u32 {
        self.nodes.len() as u32 * (self.gpus / degree)
    }
}

fn is_divisibility_chain(sizes: &[u32], node: u32) -> bool {
    sizes.windows(2).all(|w| w[1] % w[0] == 0) && sizes.last().is_none_or(|&d| node % d == 0)
}

/// Every multiset of `sizes` (descending) filling `free` GPUs so that no size fits any more.
fn maximal_layouts(
    sizes: &[u32],
    free: u32,
    current: &mut Vec<u32>,
    out: &mut Vec<Vec<u32>>,
) -> bool {
    let index = current.len();
    if index == sizes.len() {
        if sizes.iter().all(|&d| d > free) {
            out.push(current.clone());
        }
        return out.len() <= MAX_LAYOUTS;
    }
    for count in (0..=free / sizes[index]).rev() {
        current.push(count);
        let ok = maximal_layouts(sizes, free - count * sizes[index], current, out);
        current.pop();
        if !ok {
            return false;
        }
    }
    true
}

/// Groups nodes by GPU count and picks the exact, symmetry-free packing of each group.
pub(crate) fn node_types(
    node_gpus: &[u32],
    degrees: &[u32],
) -> Result<Vec<NodeType>, PlannerError> {
    let mut sizes: Vec<u32> = node_gpus.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
        .into_iter()
        .map(|gpus| {
            let nodes = (0..node_gpus.len())
                .filter(|&n| node_gpus[n] == gpus)
                .collect();
            let fitting: Vec<usize> = (0..degrees.len()).filter(|&d| degrees[d] <= gpus).collect();
            let fitting_sizes: Vec<u32> = fitting.iter().map(|&d| degrees[d]).collect();
            let packing = if is_divisibility_chain(&fitting_sizes, gpus) {
                Packing::Pooled
            } else {
                let descending: Vec<u32> = fitting_sizes.iter().rev().copied().collect();
                let mut layouts = Vec::new();
                if !maximal_layouts(&descending, gpus, &mut Vec::new(), &mut layouts) {
                    return Err(PlannerError::TooManyLayouts {
                        gpus,
                        degrees: fitting_sizes,
                        limit: MAX_LAYOUTS,
                    });
                }
                // Back to ascending degree order.
                Packing::Layouts(
                    layouts
                        .into_iter()
                        .map(|l| l.into_iter().rev().collect())
                        .collect(),
                )
            };
            Ok(NodeType {
                gpus,
                nodes,
                degrees: fitting,
                packing,
            })
        })
        .collect()
}

/// Spreads per-type instance counts (`counts[t][k]` for the `k`-th fitting degree of type
/// `t`) over the actual nodes; returns instances per node and degree index.
///
/// Pooled types are packed first-fit decreasing, which is exact for divisibility chains;
/// layout types take `layout_nodes[t][l]` nodes of layout `l`.
pub(crate) fn place_on_nodes(
    types: &[NodeType],
    num_nodes: usize,
    num_degrees: usize,
    degrees: &[u32],
    pooled_counts: &[Vec<u32>],
    layout_nodes: &[Vec<u32>],
) -> Result<Vec<Vec<u32>>, PlannerError> {
    let mut per_node = vec![vec![0u32; num_degrees]; num_nodes];
    for (t, ty) in types.iter().enumerate() {
        match &ty.packing {
            Packing::Pooled => {
                let mut free: Vec<u32> = vec![ty.gpus; ty.nodes.len()];
                for (k, &d) in ty.degrees.iter().enumerate().rev() {
                    for _ in 0..pooled_counts[t][k] {
                        let slot = free.iter().position(|&f| f >= degrees[d]).ok_or_else(|| {
                            PlannerError::Solver {
                                solver: "placement",
                                message: format!(
                                    "{} GPUs of TP-{} do not fit on {}-GPU nodes",
                                    pooled_counts[t][k] * degrees[d],
                                    degrees[d],
                                    ty.gpus
                                ),
                            }
                        })?;
                        free[slot] -= degrees[d];
                        per_node[ty.nodes[slot]][d] += 1;
                    }
                }
            }
            Packing::Layouts(layouts) => {
                let mut nodes = ty.nodes.iter();
                for (l, layout) in layouts.iter().enumerate() {
                    for _ in 0..layout_nodes[t][l] {
                        let Some(&node) = nodes.next() else {
                            return Err(PlannerError::Solver {
                                solver: "placement",
                                message: format!("more layouts than {}-GPU nodes", ty.gpus),
                            });
                        };
                        for (k, &d) in ty.degrees.iter().enumerate() {
                            per_node[node][d] += layout[k];
                        }
                    }
                }
            }
        }
    }
    Ok(per_node)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_of_two_pool() {
        let types = node_types(&[8, 8, 4], &[1, 2, 4, 8]).unwrap();
        assert_eq!(types.len(), 2);
        assert_eq!(types[0].gpus, 4);
        assert_eq!(types[0].degrees, vec![0, 1, 2]);
        assert_eq!(types[0].packing, Packing::Pooled);
        assert_eq!(types[1].nodes, vec![0, 1]);
        assert_eq!(types[1].packing, Packing::Pooled);
    }

    #[test]
    fn non_chain_uses_maximal_layouts() {
        // 6-GPU nodes with TP 2 and 4: {4,2} and {2,2,2} are the maximal layouts.
        let types = node_types(&[6], &[2, 4]).unwrap();
        let Packing::Layouts(layouts) = &types[0].packing else {
            panic!("expected layouts")
        };
        let mut got = layouts.clone();
        got.sort();
        assert_eq!(got, vec![vec![1, 1], vec![3, 0]]);
    }

    #[test]
    fn pooled_placement_is_first_fit_decreasing() {
        let types = node_types(&[4, 4], &[1, 2, 4]).unwrap();
        let per_node =
            place_on_nodes(&types, 2, 3, &[1, 2, 4], &[vec![2, 1, 1]], &[vec![]]).unwrap();
        assert_eq!(per_node, vec![vec![0, 0, 1], vec![2, 1, 0]]);
    }

    #[test]
    fn layout_placement_assigns_nodes() {
        let types = node_types(&[6, 6], &[2, 4]).unwrap();
        let Packing::Layouts(layouts) = &types[0].packing else {
            panic!("expected layouts")
        };
        let counts: Vec<u32> = layouts
            .iter()
            .map(|l| u32::from(l == &vec![1, 1]) * 2)
            .collect();
        let per_node = place_on_nodes(&types, 2, 2, &[2, 4], &[vec![]], &[counts]).unwrap();
        assert_eq!(per_node, vec![vec![1, 1], vec![1, 1]]);
    }
}
