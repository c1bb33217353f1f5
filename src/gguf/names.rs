//! Hugging Face tensor names → llama.cpp's (`convert_hf_to_gguf.py`'s table for Llama,
//! Mistral and Qwen2), and the Q/K row order llama.cpp's interleaved RoPE expects.

use candle_core::Tensor;

use super::quant::TensorRole;

/// One weight as llama.cpp names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufName {
    /// llama.cpp's name (`blk.3.attn_q.weight`).
    pub name: String,
    /// Its role for the quantization mix.
    pub role: TensorRole,
    /// The Q/K permutation to apply: the number of heads the rows are grouped in.
    pub permute_heads: Option<usize>,
}

/// What the mapping needs to know of the model.
#[derive(Debug, Clone, Copy)]
pub struct NameContext {
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Whether Q/K rows are permuted (Llama and Mistral use llama.cpp's "normal" RoPE, which
    /// rotates adjacent pairs; transformers rotates halves).
    pub permute_qk: bool,
}

/// The llama.cpp name of an HF weight; `None` for weights llama.cpp does not store (RoPE's
/// `inv_freq` buffers).
pub fn gguf_name(hf: &str, ctx: &NameContext) -> Option<GgufName> {
    let matrix = hf.ends_with(".weight") && !hf.contains("norm");
    let vector_or = |role| if matrix { role } else { TensorRole::Vector };
    let simple = |name: &str, role| {
        Some(GgufName {
            name: name.to_string(),
            role: vector_or(role),
            permute_heads: None,
        })
    };
    match hf {
        "model.embed_tokens.weight" => {
            return simple("token_embd.weight", TensorRole::TokenEmbedding)
        }
        "lm_head.weight" => return simple("output.weight", TensorRole::Output),
        "model.norm.weight" => return simple("output_norm.weight", TensorRole::Vector),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
    let short = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    let role = vector_or(match short {
        "attn_v" => TensorRole::AttentionV {
            index: layer,
            count: ctx.layers,
        },
        "ffn_down" => TensorRole::FfnDown {
            layer,
            layers: ctx.layers,
        },
        _ => TensorRole::OtherMatrix,
    });
    let permute_heads = match short {
        "attn_q" if ctx.permute_qk => Some(ctx.heads),
        "attn_k" if ctx.permute_qk => Some(ctx.kv_heads),
        _ => None,
    };
    Some(GgufName {
        name: format!("blk.{layer}.{short}.{kind}"),
        role,
        permute_heads,
    })
}

/// Reorders the rows of a Q or K projection (weight `[out, in]` or bias `[out]`) from
/// transformers' half-split RoPE layout to llama.cpp's interleaved one: within each head,
/// row `i` of the first half and row `i` of the second half become rows `2i` and `2i + 1`.
pub fn permute_qk(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    let half = rows / heads / 2;
    let mut shape = vec![heads, 2, half];
    shape.extend_from_slice(&dims[1..]);
    t.reshape(shape)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn ctx() -> NameContext {
        NameContext {
            layers: 2,
            heads: 4,
            kv_heads: 2,
            permute_qk: true,
        }
    }

    #[test]
    fn hf_names_map_to_llama_cpp_names() {
        let n = |hf| gguf_name(hf, &ctx()).map(|g| g.name);
        assert_eq!(
            n("model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(
            n("model.layers.1.self_attn.q_proj.bias").as_deref(),
            Some("blk.1.attn_q.bias")
        );
        assert_eq!(
            n("model.layers.0.mlp.down_proj.weight").as_deref(),
            Some("blk.0.ffn_down.weight")
        );
        assert_eq!(
            n("model.layers.0.post_attention_layernorm.weight").as_deref(),
            Some("blk.0.ffn_norm.weight")
        );
        assert_eq!(n("model.layers.0.self_attn.rotary_emb.inv_freq"), None);
        let k = gguf_name("model.layers.0.self_attn.k_proj.weight", &ctx()).unwrap();
        assert_eq!(k.permute_heads, Some(2));
        let bias = gguf_name("model.layers.0.self_attn.q_proj.bias", &ctx()).unwrap();
        assert_eq!(bias.role, TensorRole::Vector);
        assert_eq!(bias.permute_heads, Some(4));
    }

    #[test]
    fn the_permutation_interleaves_each_heads_halves() {
        // 2 heads of 4 rows: head 0 rows [0 1 | 2 3] -> [0 2 1 3].
        let t = Tensor::arange(0f32, 8., &Device::Cpu).unwrap();
        let p = permute_qk(&t, 2).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(p, vec![0., 2., 1., 3., 4., 6., 5., 7.]);
    }
}
