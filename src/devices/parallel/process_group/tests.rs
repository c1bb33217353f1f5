//! Process groups of threads over 127.0.0.1: the sum in rank order on every rank, and a
//! rank that does not fit or goes away named instead of a hang.

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::*;

/// `world` connected groups, rank 0 first, with `timeout` per collective.
fn groups(world: usize, timeout: Duration) -> Vec<ProcessGroup> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = listener.local_addr().unwrap();
    let mut others = Vec::new();
    let mut at_zero = Vec::new();
    for rank in 1..world {
        let out = TcpStream::connect(at).unwrap();
        let (back, _) = listener.accept().unwrap();
        others.push(GroupPeer::new(0, "host0".into(), out));
        at_zero.push(GroupPeer::new(rank, format!("host{rank}"), back));
    }
    let place = |rank| GroupPlace {
        rank,
        local_rank: rank,
        world_size: world,
    };
    let mut out = vec![ProcessGroup::new(place(0), [0; 128], at_zero, timeout).unwrap()];
    for (i, peer) in others.into_iter().enumerate() {
        out.push(ProcessGroup::new(place(i + 1), [0; 128], vec![peer], timeout).unwrap());
    }
    out
}

fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| 0.1 * (i as f32 + 1.0) / (rank as f32 + 3.0))
        .collect()
}

/// Three ranks: every rank gets ((r0 + r1) + r2) bit for bit, for a tensor longer than a
/// chunk, and the f64 scalars sum exactly.
#[test]
fn three_ranks_get_the_sum_in_rank_order_bit_for_bit() {
    let n = 300_001;
    let results: Vec<(Vec<f32>, Vec<f64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = groups(3, Duration::from_secs(20))
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                s.spawn(move || {
                    let mut t = vec![
                        NamedValues {
                            name: "w".to_string(),
                            dims: vec![n],
                            values: values(rank, n),
                        },
                        NamedValues {
                            name: "empty".to_string(),
                            dims: vec![0],
                            values: vec![],
                        },
                    ];
                    g.all_reduce("test sum", &mut t).unwrap();
                    let scalars = g.all_reduce_f64("count", &[rank as f64, 1.5]).unwrap();
                    (t.swap_remove(0).values, scalars)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (r0, r1, r2) = (values(0, n), values(1, n), values(2, n));
    let expected: Vec<f32> = (0..n)
        .map(|i| {
            let mut s = r0[i];
            s += r1[i];
            s += r2[i];
            s
        })
        .collect();
    for (rank, (sum, scalars)) in results.iter().enumerate() {
        let same = sum
            .iter()
            .zip(&expected)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "rank {rank}'s sum differs");
        assert_eq!(scalars, &vec![3.0, 4.5]);
    }
}

/// A rank with another shape is named on rank 0; a rank that goes away (its group dropped)
/// is named within the second, well before the timeout.
#[test]
fn a_rank_that_does_not_fit_or_goes_away_is_named() {
    let mut g = groups(2, Duration::from_secs(20));
    let one = g.pop().unwrap();
    let zero = g.pop().unwrap();
    let tensor = |dims: Vec<usize>| {
        vec![NamedValues {
            name: "lm_head.weight".to_string(),
            values: vec![1.0f32; dims.iter().product()],
            dims,
        }]
    };
    let err = std::thread::scope(move |s| {
        s.spawn(move || one.all_reduce("gradient all-reduce", &mut tensor(vec![2, 3])));
        let err = zero
            .all_reduce("gradient all-reduce", &mut tensor(vec![3, 2]))
            .unwrap_err()
            .to_string();
        // Closing rank 0's side ends rank 1's wait for the sum (a launched run's rank 0
        // stops its process).
        drop(zero);
        err
    });
    assert!(err.contains("rank 1 (of 2) on host1"), "{err}");
    assert!(err.contains("[2, 3]") && err.contains("[3, 2]"), "{err}");

    let mut g = groups(2, Duration::from_secs(20));
    drop(g.pop());
    let started = Instant::now();
    let err = g[0]
        .all_reduce("gradient all-reduce", &mut tensor(vec![2]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank 1 (of 2) on host1 closed its connection"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}
