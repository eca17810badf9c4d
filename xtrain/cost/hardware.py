"""Dense peak FLOP/s of one JAX device, by device kind and compute dtype (for MFU).

Dense figures (no structured sparsity), per JAX device: one GPU, or one NeuronCore as the
Neuron PJRT plugin exposes it. Sources:
- A100 (SXM and PCIe): NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS BF16/FP16,
  156 TF32, 19.5 FP32.
- H100 SXM: NVIDIA H100 datasheet: 989 TFLOPS BF16/FP16 (1,979 with sparsity), 495 TF32,
  67 FP32. H100 PCIe: 756 BF16/FP16, 378 TF32, 51 FP32. H100 NVL: 835 BF16/FP16, 418 TF32, 60 FP32.
- H200 SXM: NVIDIA H200 datasheet: the same compute as H100 SXM (989 / 495 / 67);
  H200 NVL: 835 / 418 / 60.
- Trainium1 (trn1): AWS Neuron docs, "Trainium Architecture": a chip (2 NeuronCore-v2)
  delivers 190 FP16/BF16/TF32 TFLOPS and 47.5 FP32 -> 95 and 23.75 per NeuronCore.
- Trainium2 (trn2): AWS Neuron docs, "Trainium2 Architecture": a chip (8 NeuronCore-v3)
  delivers 667 BF16/FP16/TF32 TFLOPS and 181 FP32 -> 83.375 and 22.625 per physical core; a
  JAX device is a logical core of 2 physical cores under trn2's default LNC=2 -> 166.75 and 45.25.
"""
from __future__ import annotations

T = 1e12

# (substring of the lowercased device_kind, {dtype: dense FLOP/s}); first match wins, so the
# more specific names (H100 PCIe, H200 NVL) come before the general ones.
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("a100", {"bfloat16": 312 * T, "float16": 312 * T, "tfloat32": 156 * T, "float32": 19.5 * T}),
    ("h100 pcie", {"bfloat16": 756 * T, "float16": 756 * T, "tfloat32": 378 * T, "float32": 51 * T}),
    ("h100 nvl", {"bfloat16": 835 * T, "float16": 835 * T, "tfloat32": 418 * T, "float32": 60 * T}),
    ("h200 nvl", {"bfloat16": 835 * T, "float16": 835 * T, "tfloat32": 418 * T, "float32": 60 * T}),
    ("h100", {"bfloat16": 989 * T, "float16": 989 * T, "tfloat32": 495 * T, "float32": 67 * T}),
    ("h200", {"bfloat16": 989 * T, "float16": 989 * T, "tfloat32": 495 * T, "float32": 67 * T}),
    # Neuron PJRT device kinds: NC_v2 = a trn1 NeuronCore; NC_v3d = a trn2 logical core of two
    # physical cores (LNC=2, trn2's default); NC_v3 = one trn2 physical core (LNC=1).
    ("nc_v2", {"bfloat16": 95 * T, "float16": 95 * T, "tfloat32": 95 * T, "float32": 23.75 * T}),
    ("nc_v3d", {"bfloat16": 166.75 * T, "float16": 166.75 * T, "tfloat32": 166.75 * T, "float32": 45.25 * T}),
    ("nc_v3", {"bfloat16": 83.375 * T, "float16": 83.375 * T, "tfloat32": 83.375 * T, "float32": 22.625 * T}),
)


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device of `device_kind` (jax `Device.device_kind`) computing in
    `dtype` ("bfloat16", "float16", "tfloat32", "float32"); None when unknown (CPU, other GPUs)."""
    kind = device_kind.lower()
    for name, peaks in _PEAKS:
        if name in kind:
            return peaks.get(dtype)
    return None
