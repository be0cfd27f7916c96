//! The generated IQ tables (`quant::grids`): sizes and a few entries pinned to ggml's values.

use redlite_gguf::quant::grids::*;

#[test]
fn table_sizes() {
    assert_eq!(IQ2XXS_GRID.len(), 256);
    assert_eq!(IQ2XS_GRID.len(), 512);
    assert_eq!(IQ2S_GRID.len(), 1024);
    assert_eq!(IQ3XXS_GRID.len(), 256);
    assert_eq!(IQ3S_GRID.len(), 512);
    assert_eq!(IQ1S_GRID.len(), 2048);
    assert_eq!(KSIGNS_IQ2XS.len(), 128);
    assert_eq!(KVALUES_IQ4NL.len(), 16);
}

#[test]
fn known_entries() {
    assert_eq!(IQ2XXS_GRID[0], 0x0808080808080808);
    assert_eq!(IQ2XXS_GRID[1], 0x080808080808082b);
    assert_eq!(IQ2XS_GRID[1], 0x080808080808082b);
    assert_eq!(IQ2S_GRID[0], 0x0808080808080808);
    assert_eq!(IQ3XXS_GRID[0], 0x04040404);
    assert_eq!(IQ3XXS_GRID[1], 0x04040414);
    assert_eq!(IQ3S_GRID[0], 0x01010101);
    assert_eq!(IQ3S_GRID[1], 0x01010103);
    assert_eq!(IQ1S_GRID[0], 0xffffffffffffffff);
    assert_eq!(IQ1S_GRID[1], 0xffffffffffffff01);
    assert_eq!(
        KVALUES_IQ4NL,
        [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
    );
}

#[test]
fn grid_values_are_in_their_alphabets() {
    let bytes = |row: u64, n: usize| (0..n).map(move |j| (row >> (8 * j)) as u8);
    for row in IQ2XXS_GRID.iter().chain(&IQ2XS_GRID).chain(&IQ2S_GRID) {
        assert!(bytes(*row, 8).all(|b| [8, 25, 43].contains(&b)), "{row:#x}");
    }
    for row in &IQ3XXS_GRID {
        let ok = [4, 12, 20, 28, 36, 44, 52, 62];
        assert!(
            bytes(u64::from(*row), 4).all(|b| ok.contains(&b)),
            "{row:#x}"
        );
    }
    for row in &IQ3S_GRID {
        assert!(
            bytes(u64::from(*row), 4).all(|b| b % 2 == 1 && b <= 15),
            "{row:#x}"
        );
    }
    for row in &IQ1S_GRID {
        assert!(
            bytes(*row, 8).all(|b| [0xff, 0, 1].contains(&b)),
            "{row:#x}"
        );
    }
    // Rows of a grid are distinct (they are lattice points).
    let mut sorted = IQ1S_GRID.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), IQ1S_GRID.len());
}

#[test]
fn ksigns_follow_the_parity_formula() {
    for (i, &s) in KSIGNS_IQ2XS.iter().enumerate() {
        let i = i as u8;
        assert_eq!(s, i | (((i.count_ones() & 1) as u8) << 7), "ksigns[{i}]");
        assert_eq!(s.count_ones() % 2, 0, "ksigns[{i}] has even parity");
    }
}
