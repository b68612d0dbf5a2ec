//! A forest specialised to the scheduler's candidate thresholds, walked without branches.
//!
//! For each tree and each candidate value of the varying feature (the threshold), the
//! splits on that feature are decided once, leaving a smaller tree over the other
//! features; values that leave the same tree share it (a group). Each group is then walked
//! for many requests in lock step: every walk takes exactly the group's depth in steps
//! (a leaf points to itself), so the walk has no data-dependent branch and the walks of
//! different requests overlap in the processor. Leaf values are added in tree order, as
//! LightGBM sums them, so results equal [`Forest::predict_varying`] bit for bit.

use super::forest::{Forest, Node};

/// Requests walked together.
pub(crate) const LANES: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq)]
struct Flat {
    threshold: f64,
    /// Leaf value (leaves only).
    value: f64,
    feature: u32,
    children: [u32; 2],
    nan_left: bool,
    zero_missing: bool,
    default_left: bool,
}

impl Flat {
    #[inline(always)]
    fn next(&self, x: f64) -> u32 {
        let nan = x.is_nan();
        let zero = self.zero_missing & ((x == 0.0) | nan);
        let left =
            (zero & self.default_left) | (!zero & ((x <= self.threshold) | (nan & self.nan_left)));
        self.children[usize::from(!left)]
    }
}

#[derive(Clone, Copy, Debug)]
struct Group {
    /// Bits of the values this tree serves.
    mask: u64,
    root: u32,
    depth: u32,
}

/// A forest specialised to fixed values of one feature (at most 64 values).
#[derive(Debug)]
pub(crate) struct Specialized {
    values: Vec<f64>,
    nodes: Vec<Flat>,
    /// Groups of every tree, in tree order.
    groups: Vec<Group>,
}

impl Specialized {
    /// `values` must already be normalised and number at most 64.
    pub fn new(forest: &Forest, vary: usize, values: &[f64]) -> Self {
        assert!(values.len() <= 64, "specialise at most 64 values at once");
        let mut spec = Self {
            values: values.to_vec(),
            nodes: Vec::new(),
            groups: Vec::new(),
        };
        for tree in &forest.trees {
            let first_group = spec.groups.len();
            for (j, &value) in values.iter().enumerate() {
                let start = spec.nodes.len() as u32;
                let (root, depth) = spec.build(forest, vary, value, tree.root);
                let same = spec.groups[first_group..]
                    .iter()
                    .position(|g| g.depth == depth && spec.same_tree(g.root, root, start));
                match same {
                    Some(i) => {
                        spec.nodes.truncate(start as usize);
                        spec.groups[first_group + i].mask |= 1u64 << j;
                    }
                    None => spec.groups.push(Group {
                        mask: 1u64 << j,
                        root,
                        depth,
                    }),
                }
            }
        }
        spec
    }

    pub fn values(&self) -> &[f64] {
        &self.values
    }

    /// Whether values share specialised trees enough for lock-step walks to beat one
    /// forking walk per request: at most two trees per original tree on average. When the
    /// threshold splits near every root (as in dilaserve-tiny's booster) each value gets a
    /// tree of its own, and the forking walk, which shares everything above the first
    /// threshold split, does less work.
    pub fn worthwhile(&self, trees: usize) -> bool {
        self.groups.len() <= 2 * trees.max(1)
    }

    /// Copies the subtree at `node` with splits on `vary` decided for `value`; returns the
    /// new root and the depth of the copy.
    fn build(&mut self, forest: &Forest, vary: usize, value: f64, node: i32) -> (u32, u32) {
        if node < 0 {
            let at = self.nodes.len() as u32;
            self.nodes.push(Flat {
                threshold: 0.0,
                value: forest.leaves[!node as usize],
                feature: 0,
                children: [at, at],
                nan_left: false,
                zero_missing: false,
                default_left: false,
            });
            return (at, 0);
        }
        let n: &Node = &forest.nodes[node as usize];
        if n.feature as usize == vary {
            return self.build(forest, vary, value, n.child(n.goes_left(value)));
        }
        let at = self.nodes.len() as u32;
        self.nodes.push(Flat {
            threshold: n.threshold,
            value: 0.0,
            feature: n.feature,
            children: [0, 0],
            nan_left: n.nan_left,
            zero_missing: n.zero_missing,
            default_left: n.default_left,
        });
        let (left, dl) = self.build(forest, vary, value, n.left());
        let (right, dr) = self.build(forest, vary, value, n.right());
        self.nodes[at as usize].children = [left, right];
        (at, 1 + dl.max(dr))
    }

    /// Whether the copies rooted at `a` and `b` are the same tree (`b` starts at `start`,
    /// after every node of `a`).
    fn same_tree(&self, a: u32, b: u32, start: u32) -> bool {
        let (na, nb) = (&self.nodes[a as usize], &self.nodes[b as usize]);
        let a_leaf = na.children[0] == a;
        let b_leaf = nb.children[0] == b;
        if a_leaf || b_leaf {
            return a_leaf && b_leaf && na.value.to_bits() == nb.value.to_bits();
        }
        debug_assert!(b >= start);
        na.feature == nb.feature
            && na.threshold.to_bits() == nb.threshold.to_bits()
            && (na.nan_left, na.zero_missing, na.default_left)
                == (nb.nan_left, nb.zero_missing, nb.default_left)
            && self.same_tree(na.children[0], nb.children[0], start)
            && self.same_tree(na.children[1], nb.children[1], start)
    }

    /// Raw scores of up to [`LANES`] rows: `out[l * k + j]` is row `l` at value `j`.
    /// Rows hold the forest's features (normalised) first; the varying one is ignored.
    pub fn raw_scores<const W: usize>(&self, rows: &[[f64; W]], out: &mut [f64]) {
        let k = self.values.len();
        let lanes = rows.len();
        debug_assert!(lanes <= LANES && out.len() == lanes * k);
        out.fill(0.0);
        let mut node = [0u32; LANES];
        for g in &self.groups {
            node[..lanes].fill(g.root);
            for _ in 0..g.depth {
                for (slot, row) in node[..lanes].iter_mut().zip(rows) {
                    let n = &self.nodes[*slot as usize];
                    *slot = n.next(row[n.feature as usize]);
                }
            }
            for (l, &slot) in node[..lanes].iter().enumerate() {
                let v = self.nodes[slot as usize].value;
                let acc = &mut out[l * k..(l + 1) * k];
                let mut bits = g.mask;
                while bits != 0 {
                    let j = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    acc[j] += v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_TREES: &str = include_str!("testdata/two_trees.txt");

    #[test]
    fn equals_the_forking_walk() {
        let forest = Forest::from_text(TWO_TREES).unwrap();
        let values = [-1.0, 0.0, 0.02, 0.5, 1.2, f64::NAN, 3.0];
        let rows: Vec<[f64; 3]> = (0..11)
            .map(|i| {
                let x = f64::from(i) * 0.37 - 1.5;
                [
                    x,
                    if i % 3 == 0 { f64::NAN } else { -x },
                    if i % 4 == 0 { 0.0 } else { x * 0.5 },
                ]
            })
            .collect();
        for vary in 0..3 {
            let spec = Specialized::new(&forest, vary, &values);
            for chunk in rows.chunks(LANES) {
                let mut got = vec![0.0; chunk.len() * values.len()];
                spec.raw_scores(chunk, &mut got);
                let flat: Vec<f64> = chunk.iter().flatten().copied().collect();
                let mut want = vec![0.0; got.len()];
                forest
                    .predict_varying(&flat, vary, &values, &mut want)
                    .unwrap();
                let got: Vec<u64> = got.iter().map(|x| x.to_bits()).collect();
                let want: Vec<u64> = want.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "vary {vary}");
            }
            // Values that decide every split on the varying feature alike share one tree.
            assert!(spec.groups.len() <= forest.num_trees() * values.len());
        }
    }
}
