//! The rendezvous between threads on 127.0.0.1: the id and hosts handed out, a rank that
//! never joins named, a world that does not fit together refused, a failing rank stopping
//! the others through rank 0.

use super::*;
use crate::devices::launch::{LaunchError, Launcher};
use std::net::TcpListener;
use std::sync::mpsc;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spec(rank: usize, world_size: usize, port: u16) -> WorldSpec {
    WorldSpec {
        rank,
        local_rank: rank,
        world_size,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        launcher: Launcher::Torchrun,
    }
}

fn join(rank: usize, world: usize, port: u16, secs: u64) -> Result<Rendezvous, LaunchError> {
    Rendezvous::join(&spec(rank, world, port), Duration::from_secs(secs), || {
        Ok([rank as u8 + 42; ID_BYTES])
    })
}

/// Three ranks started in reverse order: every rank gets rank 0's id and the same hosts,
/// and all finish together.
#[test]
fn every_rank_receives_rank_0s_id() {
    let port = free_port();
    let others: Vec<_> = [2, 1]
        .into_iter()
        .map(|r| std::thread::spawn(move || join(r, 3, port, 20)))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let rank0 = join(0, 3, port, 20).unwrap();
    assert_eq!(rank0.id(), &[42; ID_BYTES]);
    let joined: Vec<Rendezvous> = others
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    for r in &joined {
        assert_eq!(r.id(), rank0.id(), "rank {}", r.spec().rank);
        assert_eq!(r.hosts(), rank0.hosts());
    }
    assert_eq!(rank0.hosts().len(), 3);
    let finishing: Vec<_> = joined
        .into_iter()
        .map(|r| std::thread::spawn(move || r.finish_together(Duration::from_secs(10))))
        .collect();
    rank0.finish_together(Duration::from_secs(10)).unwrap();
    for f in finishing {
        f.join().unwrap().unwrap();
    }
}

/// A world of one listens on nothing (here, on a port another listener holds) and has its
/// own id at once.
#[test]
fn a_world_of_one_needs_no_port() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let rank0 = join(0, 1, port, 1).unwrap();
    assert_eq!((rank0.id()[0], rank0.hosts().len()), (42, 1));
}

/// Rank 2 of 3 never starts: rank 0 names it (not rank 1, which joined) within the timeout,
/// and rank 1 is told to stop with the same message rather than waiting.
#[test]
fn a_rank_that_never_joins_is_named_and_stops_the_others() {
    let port = free_port();
    let rank1 = std::thread::spawn(move || join(1, 3, port, 10));
    let started = Instant::now();
    let err = join(0, 3, port, 2).err().unwrap().to_string();
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    assert!(err.contains("rank 2 (of 3) did not join"), "{err}");
    assert!(
        err.contains(&format!("127.0.0.1:{port} within 2 s")),
        "{err}"
    );
    let told = rank1.join().unwrap().err().unwrap();
    assert!(
        matches!(&told, LaunchError::Aborted(m) if m.contains("rank 2 (of 3)")),
        "{told}"
    );
}

/// A joining rank with no rank 0 to reach names the address and rank 0 when it gives up.
#[test]
fn a_rank_without_rank_0_names_the_address() {
    let port = free_port();
    let err = join(1, 2, port, 1).err().unwrap().to_string();
    assert!(
        err.contains(&format!(
            "rank 0's rendezvous at 127.0.0.1:{port} within 1 s"
        )),
        "{err}"
    );
}

/// Two processes claiming rank 1, or a rank started with another world size: refused by
/// name, and every rank told.
#[test]
fn a_world_that_does_not_fit_together_is_refused() {
    let port = free_port();
    let a = std::thread::spawn(move || join(1, 3, port, 10));
    std::thread::sleep(Duration::from_millis(200));
    let b = std::thread::spawn(move || join(1, 3, port, 10));
    let err = join(0, 3, port, 10).err().unwrap().to_string();
    assert!(err.contains("rank 1 joined twice"), "{err}");
    for h in [a, b] {
        assert!(matches!(h.join().unwrap(), Err(LaunchError::Aborted(_))));
    }

    let port = free_port();
    let other = std::thread::spawn(move || join(1, 4, port, 10));
    let err = join(0, 2, port, 10).err().unwrap().to_string();
    assert!(err.contains("world of 4 ranks"), "{err}");
    assert!(other.join().unwrap().is_err());
}

/// After the join, rank 2 fails: rank 0 relays its reason to rank 1, and both watchers
/// report it, naming rank 2. A rank that finished first stops nobody.
#[test]
fn a_failing_rank_stops_every_rank() {
    let port = free_port();
    let others: Vec<_> = [1, 2]
        .into_iter()
        .map(|r| std::thread::spawn(move || join(r, 3, port, 20)))
        .collect();
    let rank0 = join(0, 3, port, 20).unwrap();
    let mut joined: Vec<Rendezvous> = others
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    let rank2 = joined.pop().unwrap();
    let rank1 = joined.pop().unwrap();
    let (tx, rx) = mpsc::channel();
    for (name, r) in [("rank 0", &rank0), ("rank 1", &rank1)] {
        let tx = tx.clone();
        r.watch(move |reason| tx.send((name, reason)).unwrap())
            .unwrap();
    }
    rank2.abort("step 3 ran out of memory");
    let mut told: Vec<(&str, String)> = (0..2)
        .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
        .collect();
    told.sort();
    for (who, reason) in &told {
        assert!(reason.contains("rank 2 (of 3)"), "{who}: {reason}");
        assert!(
            reason.contains("step 3 ran out of memory"),
            "{who}: {reason}"
        );
    }
    assert_eq!(told[0].0, "rank 0");
    assert_eq!(told[1].0, "rank 1");
}

/// A rank that vanishes without a word (its process killed) is noticed by its closed
/// connection; one that said it finished is not.
#[test]
fn a_rank_that_vanishes_is_named_and_one_that_finished_is_not() {
    let port = free_port();
    let others: Vec<_> = [1, 2]
        .into_iter()
        .map(|r| std::thread::spawn(move || join(r, 3, port, 20)))
        .collect();
    let rank0 = join(0, 3, port, 20).unwrap();
    let mut joined: Vec<Rendezvous> = others
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    let (tx, rx) = mpsc::channel();
    rank0.watch(move |reason| tx.send(reason).unwrap()).unwrap();
    let rank2 = joined.pop().unwrap();
    let rank1 = joined.pop().unwrap();
    rank1.finish();
    drop(rank1);
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "a finished rank stopped the run"
    );
    drop(rank2);
    let reason = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(reason.contains("rank 2 on"), "{reason}");
    assert!(
        reason.contains("closed its connection without finishing"),
        "{reason}"
    );
}

/// After the rendezvous, three ranks open the process group at the port rank 0 sent (a
/// connection that is not a rank of this run is dropped, not taken for one) and sum through
/// it; a second opening is refused.
#[test]
fn the_ranks_open_the_process_group_from_the_rendezvous() {
    let port = free_port();
    let group = |r: Rendezvous| r.process_group(Duration::from_secs(10)).map(|g| (r, g));
    let others: Vec<_> = [2, 1]
        .into_iter()
        .map(|rank| std::thread::spawn(move || group(join(rank, 3, port, 20).unwrap())))
        .collect();
    let rank0 = join(0, 3, port, 20).unwrap();
    let DataChannel::Listener(listener) = &rank0.data else {
        panic!("rank 0 holds no process-group listener");
    };
    let data_port = listener
        .lock()
        .unwrap()
        .as_ref()
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut stray = std::net::TcpStream::connect(("127.0.0.1", data_port)).unwrap();
    std::io::Write::write_all(&mut stray, b"GET / HTTP/1.1\r\n\r\n").unwrap();
    drop(stray);
    let (rank0, zero) = group(rank0).unwrap();
    let sums: Vec<_> = others
        .into_iter()
        .map(|h| {
            let (_rendezvous, g) = h.join().unwrap().unwrap();
            std::thread::spawn(move || g.all_reduce_f64("count", &[g.rank() as f64]))
        })
        .collect();
    assert_eq!(zero.all_reduce_f64("count", &[0.5]).unwrap(), vec![3.5]);
    for s in sums {
        assert_eq!(s.join().unwrap().unwrap(), vec![3.5]);
    }
    let again = rank0.process_group(Duration::from_secs(1)).unwrap_err();
    assert!(again.to_string().contains("already opened"), "{again}");
}
