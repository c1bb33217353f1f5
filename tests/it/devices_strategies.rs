//! Device strategies on CPU logical devices: a layer split and data parallel
//! must reproduce the one-device step, and the bytes placed on each device
//! must be the planner's.
use crate::support::fixture;

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use tunestudio::devices::parallel::{data_parallel_step, DeviceBatch, HostReducer};
use tunestudio::devices::strategy::{stage_costs, stage_costs_from_params};
use tunestudio::devices::{
    Assignment, LayerSplit, LogicalDevice, ParamBlock, PlacedBytes, Strategy,
};
use tunestudio::model::{CausalLm, Gradients};
use tunestudio::plan::{self, DeviceSpec, PlanRequest, Precision};

fn reference_batch(name: &str) -> DeviceBatch {
    let r: HashMap<String, Tensor> =
        candle_core::safetensors::load(fixture(name).join("reference.safetensors"), &Device::Cpu)
            .unwrap();
    DeviceBatch {
        input_ids: r["input_ids"].to_dtype(DType::U32).unwrap(),
        attention_mask: Some(r["attention_mask"].to_dtype(DType::U32).unwrap()),
        labels: r["labels"].to_dtype(DType::I64).unwrap(),
    }
}

/// Mean loss and gradients of the mean loss on one model.
fn mean_step(model: &CausalLm, b: &DeviceBatch) -> (f64, Gradients) {
    let out = model
        .loss(&b.input_ids, b.attention_mask.as_ref(), &b.labels)
        .unwrap();
    let mean = out.mean().unwrap();
    let mut g = model.backward(&out.sum).unwrap();
    g.scale(1.0 / out.num_tokens as f64).unwrap();
    (mean, g)
}

/// max over tensors of max|a − b| / max|b|.
fn worst_rel(a: &Gradients, b: &Gradients) -> f64 {
    assert_eq!(a.len(), b.len(), "gradient sets differ in size");
    let mut worst = 0.0f64;
    for (name, gb) in b.iter() {
        let ga = a
            .get(name)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_eq!(ga.dims(), gb.dims(), "{name}");
        let d = (ga - gb)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap();
        let m = gb.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let (d, m) = (
            d.to_scalar::<f32>().unwrap() as f64,
            m.to_scalar::<f32>().unwrap() as f64,
        );
        worst = worst.max(d / m.max(1e-20));
    }
    worst
}

#[test]
fn layer_split_over_two_logical_devices_equals_one_device() {
    for name in ["tiny-llama", "tiny-mistral"] {
        let b = reference_batch(name);
        let one = CausalLm::load(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        let (loss1, g1) = mean_step(&one, &b);

        let mut split = CausalLm::load(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        let costs = stage_costs_from_params(split.params(), false).unwrap();
        let a = Assignment::new(Strategy::LayerSplit, LogicalDevice::cpus(2), &costs).unwrap();
        // The two layers cost the same: one per device.
        match &a {
            Assignment::LayerSplit { split, .. } => assert_eq!(split.ranges, vec![0..1, 1..2]),
            other => panic!("{other:?}"),
        }
        a.apply(&mut split).unwrap();
        let (loss2, g2) = mean_step(&split, &b);
        assert!(
            (loss1 - loss2).abs() <= 1e-6,
            "{name}: loss {loss2} vs {loss1}"
        );
        let w = worst_rel(&g2, &g1);
        assert!(w <= 1e-6, "{name}: gradients differ by {w} (relative)");
    }
}

#[test]
fn data_parallel_over_two_logical_devices_equals_one_device_on_the_whole_batch() {
    let b = reference_batch("tiny-llama");
    let model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let (loss1, g1) = mean_step(&model, &b);

    // Two ranks sharing the model (CPU logical devices run in turn). The two rows
    // have 23 and 14 tokens: normalising by the total, not per rank, is what
    // makes this equal.
    let devices = LogicalDevice::cpus(2);
    let out = data_parallel_step(&[&model], &devices, &b, &HostReducer).unwrap();
    assert_eq!(
        out.per_rank
            .iter()
            .map(|r| r.num_tokens)
            .collect::<Vec<_>>(),
        vec![23, 14]
    );
    assert!(
        (out.mean_loss() - loss1).abs() <= 1e-5,
        "{} vs {loss1}",
        out.mean_loss()
    );
    let w = worst_rel(&out.grads[0], &g1);
    assert!(w <= 1e-5, "gradients differ by {w} (relative)");

    // A replica per device (as on GPUs), and three ranks with uneven rows.
    let replica = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let out = data_parallel_step(&[&model, &replica], &devices, &b, &HostReducer).unwrap();
    assert_eq!(out.grads.len(), 2);
    for g in &out.grads {
        assert!(worst_rel(g, &g1) <= 1e-5);
    }
    let double = DeviceBatch {
        input_ids: Tensor::cat(&[&b.input_ids, &b.input_ids], 0).unwrap(),
        attention_mask: Some(
            Tensor::cat(
                &[
                    b.attention_mask.as_ref().unwrap(),
                    b.attention_mask.as_ref().unwrap(),
                ],
                0,
            )
            .unwrap(),
        ),
        labels: Tensor::cat(&[&b.labels, &b.labels], 0).unwrap(),
    };
    let out =
        data_parallel_step(&[&model], &LogicalDevice::cpus(3), &double, &HostReducer).unwrap();
    assert_eq!(
        out.per_rank.iter().map(|r| r.rows).collect::<Vec<_>>(),
        vec![2, 1, 1]
    );
    assert!((out.mean_loss() - loss1).abs() <= 1e-5);
    assert!(worst_rel(&out.grads[0], &g1) <= 1e-5);
}

/// The planner's per-block bytes summed over the blocks each device holds.
fn planner_bytes(p: &plan::Plan) -> Vec<PlacedBytes> {
    let n_blocks = p.per_layer.len();
    p.per_device
        .iter()
        .map(|d| {
            let mut idx: Vec<usize> = Vec::new();
            if d.holds_embeddings {
                idx.push(0);
            }
            idx.extend(d.layers.clone().map(|l| l + 1));
            if d.holds_head {
                idx.push(n_blocks - 1);
            }
            let mut b = PlacedBytes::default();
            for i in idx {
                let m = &p.per_layer[i];
                b.weights_bytes += m.weights_bytes;
                b.master_weights_bytes += m.master_weights_bytes;
                b.gradients_bytes += m.gradients_bytes;
                b.optimizer_states_bytes += m.optimizer_states_bytes;
            }
            b
        })
        .collect()
}

#[test]
fn bytes_placed_per_logical_device_equal_the_planners() {
    for (name, precision, dtype, master) in [
        ("tiny-llama", Precision::Fp32, DType::F32, false),
        ("tiny-mistral", Precision::Fp32, DType::F32, false),
        ("tiny-qwen2", Precision::Bf16Mixed, DType::BF16, true),
    ] {
        let model = CausalLm::load(&fixture(name), dtype, &Device::Cpu).unwrap();
        let req = PlanRequest {
            model: model.config().clone(),
            precision,
            micro_batch: 1,
            gradient_accumulation: 1,
            seq_len: 24,
            activation_checkpointing: false,
            optimizer_offload: false,
            lora: None,
            strategy: plan::Strategy::LayerSplit,
            shard: Default::default(),
            devices: vec![DeviceSpec::cpu(1 << 30), DeviceSpec::cpu(1 << 30)],
            ops: tunestudio::model::OpsMode::Auto,
            process: None,
            trained_tokens: None,
            head_loss: Default::default(),
            reference: Default::default(),
            generations_per_micro_step: None,
            world: Default::default(),
        };
        let the_plan = plan::plan(&req).unwrap();
        let expected = planner_bytes(&the_plan);

        // Place the model exactly as the planner split it.
        let ranges: Vec<_> = the_plan
            .per_device
            .iter()
            .map(|d| d.layers.clone())
            .collect();
        let costs = stage_costs(&plan::layer_costs(&req));
        let split = LayerSplit {
            device_bytes: vec![0; ranges.len()],
            capacities_bytes: vec![1 << 30; ranges.len()],
            ranges,
        };
        let a = Assignment::LayerSplit {
            devices: LogicalDevice::cpus(2),
            split,
        };
        let placed = a.placed_bytes(model.params(), master).unwrap();
        assert_eq!(placed, expected, "{name} {precision}");
        assert_eq!(a.device_of(ParamBlock::Embeddings), 0);
        assert_eq!(a.device_of(ParamBlock::Head), 1);

        // The balanced split over the planner's costs agrees with the planner's here.
        let balanced =
            Assignment::new(Strategy::LayerSplit, LogicalDevice::cpus(2), &costs).unwrap();
        let balanced_placed = balanced.placed_bytes(model.params(), master).unwrap();
        assert_eq!(balanced_placed, expected, "{name}: balanced split");

        // Data parallel: every rank holds the whole model.
        let dp = Assignment::new(Strategy::DataParallel, LogicalDevice::cpus(2), &costs).unwrap();
        let all = dp.placed_bytes(model.params(), master).unwrap();
        let total: u64 = expected.iter().map(PlacedBytes::total_bytes).sum();
        assert_eq!(all[0].total_bytes(), total);
        assert_eq!(all[1], all[0]);
    }
}
