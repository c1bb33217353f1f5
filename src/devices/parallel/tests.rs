use super::*;
use candle_core::DType;

fn batch(rows: usize) -> DeviceBatch {
    let ids: Vec<u32> = (0..rows as u32 * 3).collect();
    DeviceBatch {
        input_ids: Tensor::from_vec(ids, (rows, 3), &Device::Cpu).unwrap(),
        attention_mask: None,
        labels: Tensor::zeros((rows, 3), DType::I64, &Device::Cpu).unwrap(),
    }
}

#[test]
fn nccl_only_when_every_rank_is_its_own_gpu() {
    let labels = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        choose_reducer(&labels(&["cuda:0", "cuda:1=40GiB"]), true),
        ReducerChoice::Nccl
    );
    assert_ne!(
        choose_reducer(&labels(&["cuda:0", "cuda:0#1"]), true),
        ReducerChoice::Nccl
    );
    // The GPU check's two streams of one GPU: NCCL would refuse them.
    let ReducerChoice::Host { reason } = choose_reducer(&labels(&["cuda:0", "cuda:0"]), true)
    else {
        panic!("NCCL chosen for two ranks on one GPU");
    };
    assert!(reason.contains("share cuda:0"), "{reason}");
    assert!(matches!(
        choose_reducer(&labels(&["cpu:0", "cpu:1"]), true),
        ReducerChoice::Host { .. }
    ));
    assert!(matches!(
        choose_reducer(&labels(&["cuda:0", "cuda:1"]), false),
        ReducerChoice::Host { .. }
    ));
}

#[test]
fn the_host_reducer_refuses_nothing_and_moves_each_rank_explicitly() {
    let mut a = Gradients::new();
    a.insert("w", Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap());
    let mut b = Gradients::new();
    b.insert("w", Tensor::new(&[10f32, 20.0], &Device::Cpu).unwrap());
    let out = HostReducer
        .all_reduce_sum(vec![a, b], &[Device::Cpu, Device::Cpu])
        .unwrap();
    for g in &out {
        assert_eq!(
            g.get("w").unwrap().to_vec1::<f32>().unwrap(),
            vec![11.0, 22.0]
        );
    }
}

#[test]
fn shards_are_contiguous_and_cover_the_batch() {
    let b = batch(5);
    let shards = split_batch(&b, 2).unwrap();
    assert_eq!(shards[0].rows().unwrap(), 3);
    assert_eq!(shards[1].rows().unwrap(), 2);
    let first: Vec<u32> = shards[1]
        .input_ids
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(first[0], 9);
    assert!(split_batch(&b, 6).is_err());
    assert!(split_batch(&b, 0).is_err());
}

/// y = w · Σ ids over non-ignored tokens: the gradient of the loss sum is
/// the token-id sum, so data parallel is checkable by hand.
struct Toy {
    w: candle_core::Var,
}

impl ShardModel for Toy {
    fn loss_and_grads(&self, shard: &DeviceBatch) -> Result<ShardResult, DevicesError> {
        let x = shard.input_ids.to_dtype(DType::F32)?;
        let n = shard.input_ids.elem_count();
        let sum = x.sum_all()?.broadcast_mul(self.w.as_tensor())?.sum_all()?;
        let g = sum.backward()?;
        let mut grads = Gradients::new();
        if let Some(gw) = g.get(self.w.as_tensor()) {
            grads.insert("w", gw.clone());
        }
        Ok(ShardResult {
            loss_sum: sum.to_scalar::<f32>()? as f64,
            num_tokens: n,
            grads,
        })
    }
}

#[test]
fn host_all_reduce_sums_then_normalises() {
    let toy = Toy {
        w: candle_core::Var::from_tensor(&Tensor::new(&[2f32], &Device::Cpu).unwrap()).unwrap(),
    };
    let b = batch(4);
    let devices = LogicalDevice::cpus(2);
    let out = data_parallel_step(&[&toy], &devices, &b, &HostReducer).unwrap();
    // ids 0..12 sum to 66, 12 tokens.
    assert_eq!(out.num_tokens, 12);
    assert!((out.loss_sum - 132.0).abs() < 1e-9);
    let g: Vec<f32> = out.grads[0].get("w").unwrap().to_vec1().unwrap();
    assert!((g[0] - 66.0 / 12.0).abs() < 1e-6, "{g:?}");
    assert_eq!(out.per_rank.len(), 2);
    assert_eq!(out.per_rank[1].rows, 2);
    // Two replicas (one per logical device) give the same sum on each.
    let out2 = data_parallel_step(&[&toy, &toy], &devices, &b, &HostReducer).unwrap();
    assert_eq!(out2.grads.len(), 2);
    let g2: Vec<f32> = out2.grads[1].get("w").unwrap().to_vec1().unwrap();
    assert_eq!(g, g2);
}
