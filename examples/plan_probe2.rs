use candle_core::{Device, Tensor, Var};
use tunestudio::mem::{self, CountingAllocator};
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();
fn main() {
    let dev = Device::Cpu;
    let (n, h, i) = (32usize, 576usize, 1536usize);
    let w = Var::from_tensor(&Tensor::randn(0f32, 1., (h, i), &dev).unwrap()).unwrap();
    let xv = Var::from_tensor(&Tensor::randn(0f32, 1., (n, i), &dev).unwrap()).unwrap();
    let u = (h * i * 4) as f64;
    for tracked in [false, true, false, true] {
        let x = if tracked { xv.as_tensor().clone() } else { xv.as_detached_tensor() };
        let y = x.matmul(&w.as_tensor().t().unwrap()).unwrap();
        let loss = y.sum_all().unwrap();
        let base = mem::current_bytes();
        mem::reset_peak();
        let g = loss.backward().unwrap();
        println!("tracked={tracked}: peak {:.3} units, after {:.3}", (mem::peak_bytes() - base) as f64 / u, (mem::current_bytes() - base) as f64 / u);
        drop(g);
        // direct: grad.matmul(W)
        let gr = Tensor::ones(1, candle_core::DType::F32, &dev).unwrap().reshape((1,1)).unwrap().broadcast_as((n, h)).unwrap();
        let base = mem::current_bytes();
        mem::reset_peak();
        let r = gr.matmul(&w.as_tensor().t().unwrap().t().unwrap()).unwrap();
        println!("  grad[n,h] @ W[h,i]: peak {:.3} units (out {:.3})", (mem::peak_bytes() - base) as f64 / u, (r.elem_count()*4) as f64 / u);
    }
}
