//! Quantization of the frozen base under LoRA (`[model] quantize`): QLoRA.
//!
//! The names are GGML's block formats, which candle quantizes, multiplies and dequantizes on
//! the CPU, CUDA and Metal (`candle_core::quantized`), and which a GGUF file stores as they are:
//! - `q8_0`: blocks of 32 weights, one f16 scale + 32 × i8 = 34 bytes (8.5 bits a weight);
//!   near-lossless;
//! - `q4_k`: super-blocks of 256 weights in 8 sub-blocks with 6-bit scales and minimums, one
//!   f16 scale and one f16 minimum = 144 bytes (4.5 bits a weight): llama.cpp's usual 4-bit
//!   format, the counterpart of bitsandbytes' NF4 (also ≈ 4.5 bits with its block scales).
//!
//! A weight is quantized along its input dimension (a row of `[out, in]`), so `in` must be a
//! multiple of the block. `q4_k` on a layer whose input width is not a multiple of 256 falls
//! back to `q5_0` (blocks of 32: f16 scale, 5-bit weights, 22 bytes = 5.5 bits), as llama.cpp
//! does for such tensors; a layer whose input width is not a multiple of 32 stays unquantized
//! (in the compute dtype). The planner and the loader both decide with
//! [`Quantization::format_for`], so they always agree.

use serde::{Deserialize, Serialize};

/// `[model] quantize`: how the frozen base linears are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Quantization {
    /// Base weights in the compute dtype.
    #[default]
    #[serde(rename = "none")]
    None,
    /// GGML Q8_0 (8.5 bits a weight).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// GGML Q4_K (4.5 bits a weight); Q5_0 where the input width is not a multiple of 256.
    #[serde(rename = "q4_k")]
    Q4K,
}

/// The block format one weight matrix is actually stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// 32 weights in 34 bytes.
    Q8_0,
    /// 256 weights in 144 bytes.
    Q4K,
    /// 32 weights in 22 bytes (the `q4_k` fallback).
    Q5_0,
}

impl QuantFormat {
    /// Weights per block.
    pub fn block_elems(self) -> u64 {
        match self {
            QuantFormat::Q8_0 | QuantFormat::Q5_0 => 32,
            QuantFormat::Q4K => 256,
        }
    }

    /// Bytes per block (quantized values and their scales).
    pub fn block_bytes(self) -> u64 {
        match self {
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4K => 144,
            QuantFormat::Q5_0 => 22,
        }
    }

    /// Bytes of an `[out, in]` matrix in this format (`in` a multiple of the block).
    pub fn matrix_bytes(self, in_dim: u64, out_dim: u64) -> u64 {
        out_dim * in_dim.div_ceil(self.block_elems()) * self.block_bytes()
    }

    /// GGML's name.
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4K => "q4_k",
            QuantFormat::Q5_0 => "q5_0",
        }
    }
}

impl Quantization {
    /// The accepted spellings, for messages.
    pub const NAMES: &'static [&'static str] = &["none", "q8_0", "q4_k"];

    /// Every choice, in the order the UI lists them.
    pub const ALL: [Quantization; 3] = [Quantization::None, Quantization::Q8_0, Quantization::Q4K];

    /// The name as written in the config.
    pub fn name(self) -> &'static str {
        match self {
            Quantization::None => "none",
            Quantization::Q8_0 => "q8_0",
            Quantization::Q4K => "q4_k",
        }
    }

    /// A label for menus ("QLoRA 4-bit (q4_k)").
    pub fn label(self) -> &'static str {
        match self {
            Quantization::None => "none (base in the compute dtype)",
            Quantization::Q8_0 => "QLoRA 8-bit (q8_0)",
            Quantization::Q4K => "QLoRA 4-bit (q4_k)",
        }
    }

    /// Whether the base is quantized at all.
    pub fn is_on(self) -> bool {
        self != Quantization::None
    }

    /// The format a base weight with input width `in_dim` is stored in (`None`: kept in the
    /// compute dtype). See the module doc for the fallbacks.
    pub fn format_for(self, in_dim: u64) -> Option<QuantFormat> {
        match self {
            Quantization::None => None,
            _ if in_dim == 0 || !in_dim.is_multiple_of(32) => None,
            Quantization::Q8_0 => Some(QuantFormat::Q8_0),
            Quantization::Q4K if in_dim.is_multiple_of(256) => Some(QuantFormat::Q4K),
            Quantization::Q4K => Some(QuantFormat::Q5_0),
        }
    }
}

impl std::fmt::Display for Quantization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A quantization name that is none of [`Quantization::NAMES`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("unknown quantization `{0}`: use none, q8_0 or q4_k")]
pub struct UnknownQuantization(pub String);

impl std::str::FromStr for Quantization {
    type Err = UnknownQuantization;

    /// Parses the config spelling and common aliases (`q8`, `8bit`, `int8`, `q4`, `4bit`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "none" | "off" | "no" | "" => Ok(Quantization::None),
            "q8_0" | "q8" | "8bit" | "8_bit" | "int8" => Ok(Quantization::Q8_0),
            "q4_k" | "q4k" | "q4" | "4bit" | "4_bit" | "int4" => Ok(Quantization::Q4K),
            _ => Err(UnknownQuantization(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_fallbacks() {
        for q in Quantization::ALL {
            let back: Quantization = q.name().parse().expect("parses");
            assert_eq!(back, q);
        }
        assert_eq!(Quantization::Q4K.format_for(4096), Some(QuantFormat::Q4K));
        assert_eq!(Quantization::Q4K.format_for(576), Some(QuantFormat::Q5_0));
        assert_eq!(Quantization::Q8_0.format_for(576), Some(QuantFormat::Q8_0));
        assert_eq!(Quantization::Q8_0.format_for(100), None);
        assert_eq!(QuantFormat::Q4K.matrix_bytes(4096, 1), 16 * 144);
    }
}
