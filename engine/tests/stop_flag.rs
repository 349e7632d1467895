//! A session's stop flag ([`Session::set_stop`]) stops a forward between layers: the forward
//! fails with [`Error::Stopped`], the blocks finished before it stay in the cache, the block it
//! stopped in is not committed, and the session goes on from there with the same bits as one
//! that never stopped.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use stormo_engine::{Error, LoadOptions, Logits, Model, Observer};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/gptoss-tiny-mxfp4")
}

/// Raises `flag` when hidden state `index` of block `block` (counted from 0) is seen.
struct RaiseAt {
    flag: Arc<AtomicBool>,
    block: usize,
    index: usize,
    blocks_seen: usize,
}

impl Observer for RaiseAt {
    fn hidden(&mut self, index: usize, _xs: &[f32]) {
        if index == 0 {
            self.blocks_seen += 1;
        }
        if self.blocks_seen == self.block + 1 && index == self.index {
            self.flag.store(true, Ordering::SeqCst);
        }
    }
}

#[test]
fn a_raised_flag_stops_between_layers_and_the_session_goes_on() {
    let model = Model::load(
        &tiny(),
        &LoadOptions {
            prefill_block: 8,
            ..LoadOptions::default()
        },
    )
    .expect("the fixture loads");
    let prompt: Vec<u32> = (0..30).map(|i| (i * 41 + 7) % 2000).collect();
    let mut whole = model.session(64).expect("session");
    let want = model
        .forward(&mut whole, &prompt, Logits::Last, None)
        .expect("prompt")
        .to_vec();

    // Raised after layer 1 of the second block: the first block (8 positions) stays.
    let flag = Arc::new(AtomicBool::new(false));
    let mut s = model.session(64).expect("session");
    s.set_stop(Some(flag.clone()));
    let mut obs = RaiseAt {
        flag: flag.clone(),
        block: 1,
        index: 2,
        blocks_seen: 0,
    };
    let e = model
        .forward(&mut s, &prompt, Logits::Last, Some(&mut obs))
        .expect_err("stopped");
    assert!(matches!(e, Error::Stopped), "{e}");
    assert_eq!(s.position(), 8);

    // Raised before the call: nothing runs.
    let e = model
        .forward_greedy(&mut s, &prompt[8..], None)
        .expect_err("stopped");
    assert!(matches!(e, Error::Stopped), "{e}");
    assert_eq!(s.position(), 8);

    // Lowered, the session goes on from where it stopped, with the same logits.
    flag.store(false, Ordering::SeqCst);
    let got = model
        .forward(&mut s, &prompt[8..], Logits::Last, None)
        .expect("the rest of the prompt")
        .to_vec();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want));

    // Truncated back to before the stopped turn, the session recomputes it the same.
    let mut t = model.session(64).expect("session");
    t.set_stop(Some(flag.clone()));
    model
        .forward(&mut t, &prompt[..10], Logits::Last, None)
        .expect("the first part");
    let mut obs = RaiseAt {
        flag: flag.clone(),
        block: 1,
        index: 1,
        blocks_seen: 0,
    };
    model
        .forward(&mut t, &prompt[10..], Logits::Last, Some(&mut obs))
        .expect_err("stopped");
    assert_eq!(t.position(), 18);
    assert_eq!(t.truncate(10), 10);
    t.set_stop(None);
    let again = model
        .forward(&mut t, &prompt[10..], Logits::Last, None)
        .expect("the second part again")
        .to_vec();
    assert_eq!(bits(&again), bits(&want));
}
