//! The grid tables shared by the IQ2_XXS and IQ1_M quantizers: ggml's `iq2xs_init_impl`
//! (`kgrid_q2xs`, `kmap_q2xs`, `kneighbors_q2xs`), built once per grid, and the neighbour search
//! over them; plus C's `MAX`, which both quantizers use in ggml's form.

/// Number of slots in ggml's `kmap`: every 8-element pattern with 2 bits per element that the
/// quantizers can look up (they clamp elements to 0..=2, so the largest index is 0xAAAA).
const KMAP_SIZE: usize = 43692;

/// A grid of 8-element points (coordinates in {1, 3, 5, 7}) with, for every lattice point that
/// is not on the grid, the list of grid points at its `nwant` smallest squared distances: the
/// tables of ggml's `iq2xs_init_impl` (`kgrid_q2xs`, `kmap_q2xs`, `kneighbors_q2xs`).
pub(super) struct IqGrid {
    /// Grid point i, coordinates `2l + 1`.
    points: Vec<[i8; 8]>,
    /// Grid point i as levels l (0..=2).
    levels: Vec<[u8; 8]>,
    /// Pattern index (2 bits per element) → grid index if ≥ 0, else `-(offset + 1)` into
    /// `neighbours`, where the list's length is followed by its grid indices.
    map: Vec<i32>,
    neighbours: Vec<u16>,
}

/// What a pattern index maps to: a grid point, or the candidates to search.
pub(super) enum Lookup<'a> {
    OnGrid(usize),
    Neighbours(&'a [u16]),
}

impl IqGrid {
    /// Builds the tables for `table` (gguf-py's expanded grid: byte j of entry i is element j,
    /// one of `levels`) keeping the neighbours at the `nwant` smallest distinct distances.
    pub(super) fn build(table: &[u64], levels: [u8; 3], nwant: usize) -> Self {
        let points: Vec<[i8; 8]> = table
            .iter()
            .map(|&row| {
                std::array::from_fn(|j| {
                    let byte = (row >> (8 * j)) as u8;
                    let l = levels
                        .iter()
                        .position(|&v| v == byte)
                        .expect("grid byte is one of the grid's levels")
                        as i8;
                    2 * l + 1
                })
            })
            .collect();
        let mut map = vec![-1i32; KMAP_SIZE];
        for (i, p) in points.iter().enumerate() {
            map[pattern_index(p.map(|c| (c - 1) / 2))] = i as i32;
        }
        // For each off-grid pattern: grid indices sorted by (distance², index), cut after the
        // `nwant`-th distinct distance (ggml sorts all pairs with qsort; keys are distinct).
        // Squared distances are small integers, so bucket by distance instead of sorting.
        let mut neighbours = Vec::new();
        let mut dist = vec![0u16; points.len()];
        const MAX_D2: usize = 8 * 36 + 1;
        let mut count = [0u32; MAX_D2];
        for (u, slot) in map.iter_mut().enumerate() {
            let pos: [i8; 8] = std::array::from_fn(|k| 2 * ((u >> (2 * k)) & 3) as i8 + 1);
            // Patterns with a level-3 element are never looked up; ggml builds lists for them
            // too, which only shifts offsets, not any list's content.
            if *slot >= 0 || pos.contains(&7) {
                continue;
            }
            count.fill(0);
            for (d, p) in dist.iter_mut().zip(&points) {
                let d2: i32 = (0..8)
                    .map(|k| (p[k] as i32 - pos[k] as i32) * (p[k] as i32 - pos[k] as i32))
                    .sum();
                *d = d2 as u16;
                count[d2 as usize] += 1;
            }
            let offset = neighbours.len();
            *slot = -(offset as i32 + 1);
            neighbours.push(0);
            let mut n = 0u16;
            for d2 in (0..MAX_D2).filter(|&d| count[d] > 0).take(nwant) {
                for (j, &d) in dist.iter().enumerate() {
                    if d as usize == d2 {
                        neighbours.push(j as u16);
                        n += 1;
                    }
                }
            }
            neighbours[offset] = n;
        }
        IqGrid {
            levels: points
                .iter()
                .map(|p| p.map(|c| ((c - 1) / 2) as u8))
                .collect(),
            points,
            map,
            neighbours,
        }
    }

    /// Grid point `i` (coordinates `2l + 1`).
    pub(super) fn point(&self, i: usize) -> &[i8; 8] {
        &self.points[i]
    }

    /// The grid point of `list` with the least Σᵢ terms[i][level of element i], summed in
    /// element order from 0 (as ggml's neighbour searches do); the first wins ties, and the first
    /// is returned when no sum is below `f32::MAX` (ggml aborts or falls back there).
    pub(super) fn closest(&self, list: &[u16], terms: &[[f32; 3]; 8]) -> usize {
        let mut best_d2 = f32::MAX;
        let mut best = list[0] as usize;
        for &j in list {
            let lv = &self.levels[j as usize];
            let mut d2 = 0f32;
            for i in 0..8 {
                d2 += terms[i][lv[i] as usize];
            }
            if d2 < best_d2 {
                best_d2 = d2;
                best = j as usize;
            }
        }
        best
    }

    /// Looks up the pattern of 8 levels `l` (each in 0..=2).
    pub(super) fn lookup(&self, l: &[i8]) -> Lookup<'_> {
        let levels: [i8; 8] = std::array::from_fn(|k| l[k]);
        let m = self.map[pattern_index(levels)];
        if m >= 0 {
            Lookup::OnGrid(m as usize)
        } else {
            let start = (-m - 1) as usize;
            let n = self.neighbours[start] as usize;
            Lookup::Neighbours(&self.neighbours[start + 1..start + 1 + n])
        }
    }
}

/// Index of 8 levels (each 0..=3, 2 bits each, element 0 lowest).
fn pattern_index(levels: [i8; 8]) -> usize {
    levels
        .iter()
        .enumerate()
        .fold(0, |u, (k, &l)| u | (((l as usize) & 3) << (2 * k)))
}
