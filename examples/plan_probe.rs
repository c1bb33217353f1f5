#[path = "../tests/plan_support/harness.rs"]
mod harness;
use candle_core::{DType, Device};
use tunestudio::mem::{self, CountingAllocator};
use tunestudio::model::{CausalLm, ModelConfig};
use tunestudio::plan::Precision;
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();
fn main() {
    let base = harness::model_config();
    let args: Vec<String> = std::env::args().collect();
    let dtype = if args.get(1).map(|s| s.as_str()) == Some("bf16") { DType::BF16 } else { DType::F32 };
    let ckpt = args.get(2).map(|s| s.as_str()) == Some("ckpt");
    let lora = args.get(3).map(|s| s.as_str()) == Some("lora");
    for layers in std::env::var("PL").ok().map(|v| v.split(',').map(|x| x.parse::<usize>().unwrap()).collect::<Vec<_>>()).unwrap_or(vec![1usize, 2]) {
        for (b, t) in std::env::var("PBT").ok().map(|v| v.split(';').map(|p| { let mut it = p.split(','); (it.next().unwrap().parse::<usize>().unwrap(), it.next().unwrap().parse::<usize>().unwrap()) }).collect::<Vec<_>>()).unwrap_or(vec![(1usize, 32usize), (2, 32), (1, 64), (2, 64), (1, 128), (2, 128)]) {
            let mut raw = base.raw.clone();
            raw["num_hidden_layers"] = layers.into();
            if let Some(i) = std::env::var("PI").ok().and_then(|v| v.parse::<u64>().ok()) { raw["intermediate_size"] = i.into(); }
            if let Some(hh) = std::env::var("PH").ok().and_then(|v| v.parse::<u64>().ok()) { raw["hidden_size"] = hh.into(); raw["num_attention_heads"] = (hh / 64).into(); }
            if std::env::var("PUNTIE").is_ok() { raw["tie_word_embeddings"] = false.into(); }
            raw["vocab_size"] = std::env::var("PV").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(512).into();
            let cfg = ModelConfig::from_json_str(&raw.to_string(), "probe").unwrap();
            let zero = mem::current_bytes();
            let mut model = CausalLm::random_init(&cfg, 1, dtype, &Device::Cpu).unwrap();
            if lora { model.apply_lora(&harness_lora(), 1).unwrap(); }
            let c = harness::Case { precision: if dtype == DType::F32 { Precision::Fp32 } else { Precision::Bf16Mixed }, checkpointing: ckpt, lora, micro_batch: b, seq_len: t, accumulation: 1 };
            let _ = harness::measure(&mut model, &c, zero, 5);
            let m = harness::measure(&mut model, &c, zero, 5);
            println!("L={layers} b={b} t={t}: before {} kept {} fwdpeak+ {} bwdpeak+ {} afterbwd+ {} bwdend+ {} opt+ {}", m.before, m.after_fwd as i64 - m.before as i64, m.fwd_peak as i64 - m.after_fwd as i64, m.bwd_peak as i64- m.after_fwd as i64, m.after_bwd as i64 - m.before as i64, m.bwd_end as i64 - m.after_fwd as i64, m.opt_peak as i64 - m.after_bwd as i64);
        }
    }
}
fn harness_lora() -> tunestudio::model::LoraConfig {
    tunestudio::model::LoraConfig { r: 8, alpha: 16.0, dropout: 0.0, target_modules: ["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"].iter().map(|s| s.to_string()).collect() }
}
