//! Which ggml type each tensor gets: the file types a user picks (`--quant`) and llama.cpp's
//! rules for the `_M` mixes and for rows that do not fill a block (`llama-quant.cpp`:
//! `llama_tensor_get_type_impl` and `tensor_type_fallback`), so a file written here has the
//! same per-tensor types as `llama-quantize` would give it.

use candle_core::quantized::GgmlDType;

/// What the user asks for: llama.cpp's file types (`general.file_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufQuant {
    /// Every matrix as f16 (norms stay f32).
    F16,
    /// Every matrix as bf16.
    Bf16,
    /// 8-bit blocks of 32 (~8.5 bits per weight).
    Q8_0,
    /// 6-bit k-quant everywhere.
    Q6K,
    /// 5-bit k-quant, with `attn_v`/`ffn_down` of some layers and the output at 6 bits.
    Q5KM,
    /// 4-bit k-quant, with `attn_v`/`ffn_down` of some layers and the output at 6 bits.
    Q4KM,
}

impl GgufQuant {
    /// Every choice, smallest file last.
    pub const ALL: [GgufQuant; 6] = [
        GgufQuant::F16,
        GgufQuant::Bf16,
        GgufQuant::Q8_0,
        GgufQuant::Q6K,
        GgufQuant::Q5KM,
        GgufQuant::Q4KM,
    ];

    /// The name on the command line and in file names (`q4_k_m`).
    pub fn name(self) -> &'static str {
        match self {
            GgufQuant::F16 => "f16",
            GgufQuant::Bf16 => "bf16",
            GgufQuant::Q8_0 => "q8_0",
            GgufQuant::Q6K => "q6_k",
            GgufQuant::Q5KM => "q5_k_m",
            GgufQuant::Q4KM => "q4_k_m",
        }
    }

    /// Parses a name as [`GgufQuant::name`] writes it (any case, `-` for `_` allowed).
    pub fn parse(text: &str) -> Option<Self> {
        let norm = text.trim().to_ascii_lowercase().replace('-', "_");
        Self::ALL.into_iter().find(|q| q.name() == norm)
    }

    /// llama.cpp's `llama_ftype` value, written as `general.file_type`.
    pub fn file_type(self) -> u32 {
        match self {
            GgufQuant::F16 => 1,
            GgufQuant::Q8_0 => 7,
            GgufQuant::Q4KM => 15,
            GgufQuant::Q5KM => 17,
            GgufQuant::Q6K => 18,
            GgufQuant::Bf16 => 32,
        }
    }

    /// The type of a matrix no rule singles out.
    pub fn default_type(self) -> GgmlDType {
        match self {
            GgufQuant::F16 => GgmlDType::F16,
            GgufQuant::Bf16 => GgmlDType::BF16,
            GgufQuant::Q8_0 => GgmlDType::Q8_0,
            GgufQuant::Q6K => GgmlDType::Q6K,
            GgufQuant::Q5KM => GgmlDType::Q5K,
            GgufQuant::Q4KM => GgmlDType::Q4K,
        }
    }

    fn is_quantized(self) -> bool {
        !matches!(self, GgufQuant::F16 | GgufQuant::Bf16)
    }
}

impl std::fmt::Display for GgufQuant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The role of a tensor, as llama.cpp's quantizer sees it from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// `token_embd.weight`.
    TokenEmbedding,
    /// `output.weight`.
    Output,
    /// `blk.N.attn_v.weight`; `index` counts the attn_v tensors seen before it.
    AttentionV { index: usize, count: usize },
    /// `blk.N.ffn_down.weight` of layer `layer` of `layers`.
    FfnDown { layer: usize, layers: usize },
    /// Any other matrix.
    OtherMatrix,
    /// Norm weights, biases and other vectors: always f32.
    Vector,
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third one
/// between them get more bits in the `_M` mixes.
fn use_more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8).rem_euclid(3) == 2
}

/// The ggml type of one tensor: `row_len` is its row length (ggml's `ne[0]`), `tied` whether
/// the model has no separate output matrix (then the embedding is treated as the output).
pub fn tensor_type(quant: GgufQuant, role: TensorRole, row_len: usize, tied: bool) -> GgmlDType {
    if role == TensorRole::Vector {
        return GgmlDType::F32;
    }
    let default = quant.default_type();
    if !quant.is_quantized() {
        return default;
    }
    let is_output = role == TensorRole::Output || (tied && role == TensorRole::TokenEmbedding);
    let chosen = if is_output {
        if !row_len.is_multiple_of(default.block_size()) {
            GgmlDType::Q8_0
        } else if default != GgmlDType::Q8_0 {
            GgmlDType::Q6K
        } else {
            default
        }
    } else {
        let m_mix = matches!(quant, GgufQuant::Q4KM | GgufQuant::Q5KM);
        match role {
            TensorRole::AttentionV { index, count } if m_mix && use_more_bits(index, count) => {
                GgmlDType::Q6K
            }
            TensorRole::FfnDown { layer, layers } if m_mix && use_more_bits(layer, layers) => {
                GgmlDType::Q6K
            }
            _ => default,
        }
    };
    fallback(chosen, row_len)
}

/// llama.cpp's `tensor_type_fallback`: a row that does not fill the type's blocks takes a
/// 32-wide type of about the same size, or f16 when even that does not fit.
fn fallback(ty: GgmlDType, row_len: usize) -> GgmlDType {
    if row_len.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let next = match ty {
        GgmlDType::Q4K => GgmlDType::Q5_0,
        GgmlDType::Q5K => GgmlDType::Q5_1,
        GgmlDType::Q6K => GgmlDType::Q8_0,
        other => other,
    };
    if row_len.is_multiple_of(next.block_size()) {
        next
    } else {
        GgmlDType::F16
    }
}

/// ggml's type id, as written in a tensor's info.
pub fn ggml_type_id(ty: GgmlDType) -> u32 {
    match ty {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

/// Bytes of a tensor of `elements` values (a whole number of rows) in type `ty`.
pub fn tensor_bytes(ty: GgmlDType, elements: usize) -> u64 {
    (elements / ty.block_size() * ty.type_size()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_m_mixes_give_attn_v_and_ffn_down_of_every_third_layer_six_bits() {
        // 32 layers (a 7B): llama.cpp's use_more_bits picks 0..4, 28..32 and 6, 9, 12, ...
        let more: Vec<usize> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(
            more,
            vec![0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
        let down = |layer| {
            tensor_type(
                GgufQuant::Q4KM,
                TensorRole::FfnDown { layer, layers: 32 },
                14336,
                false,
            )
        };
        assert_eq!(down(0), GgmlDType::Q6K);
        assert_eq!(down(4), GgmlDType::Q4K);
        assert_eq!(down(6), GgmlDType::Q6K);
        let q = tensor_type(GgufQuant::Q4KM, TensorRole::OtherMatrix, 4096, false);
        assert_eq!(q, GgmlDType::Q4K);
        let out = tensor_type(GgufQuant::Q4KM, TensorRole::Output, 4096, false);
        assert_eq!(out, GgmlDType::Q6K);
        // With a separate output, the embedding keeps the default type.
        let emb = tensor_type(GgufQuant::Q4KM, TensorRole::TokenEmbedding, 4096, false);
        assert_eq!(emb, GgmlDType::Q4K);
        let emb_tied = tensor_type(GgufQuant::Q4KM, TensorRole::TokenEmbedding, 4096, true);
        assert_eq!(emb_tied, GgmlDType::Q6K);
        // Q8_0 keeps the output at Q8_0; Q6_K has no mix.
        let out8 = tensor_type(GgufQuant::Q8_0, TensorRole::Output, 4096, false);
        assert_eq!(out8, GgmlDType::Q8_0);
        let v6 = TensorRole::AttentionV {
            index: 0,
            count: 32,
        };
        assert_eq!(tensor_type(GgufQuant::Q6K, v6, 4096, false), GgmlDType::Q6K);
        assert_eq!(
            tensor_type(GgufQuant::Q5KM, v6, 4096, false),
            GgmlDType::Q6K
        );
        let v5 = TensorRole::AttentionV {
            index: 4,
            count: 32,
        };
        assert_eq!(
            tensor_type(GgufQuant::Q5KM, v5, 4096, false),
            GgmlDType::Q5K
        );
    }

    #[test]
    fn rows_that_do_not_fill_a_block_fall_back_as_llama_cpp_does() {
        // The tiny fixtures: rows of 64 and 160 values, neither a multiple of 256.
        let t = |role, row| tensor_type(GgufQuant::Q4KM, role, row, false);
        assert_eq!(t(TensorRole::OtherMatrix, 64), GgmlDType::Q5_0);
        assert_eq!(t(TensorRole::Output, 64), GgmlDType::Q8_0);
        // Of 2 layers, the last gets more bits (Q6_K, which falls back to Q8_0).
        let down = |layer| TensorRole::FfnDown { layer, layers: 2 };
        assert_eq!(t(down(1), 160), GgmlDType::Q8_0);
        assert_eq!(t(down(0), 160), GgmlDType::Q5_0);
        assert_eq!(
            tensor_type(GgufQuant::Q5KM, TensorRole::OtherMatrix, 64, false),
            GgmlDType::Q5_1
        );
        // Not even 32 wide: f16.
        assert_eq!(t(TensorRole::OtherMatrix, 48), GgmlDType::F16);
        // Vectors are never quantized.
        assert_eq!(t(TensorRole::Vector, 4096), GgmlDType::F32);
    }

    #[test]
    fn names_and_file_types_round_trip() {
        for q in GgufQuant::ALL {
            assert_eq!(GgufQuant::parse(q.name()), Some(q));
        }
        assert_eq!(GgufQuant::parse("Q4_K_M"), Some(GgufQuant::Q4KM));
        assert_eq!(GgufQuant::parse("q3_k"), None);
        assert_eq!(GgufQuant::Q4KM.file_type(), 15);
    }
}
