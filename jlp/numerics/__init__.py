"""The arithmetic of jlp's formats, on float32 bit patterns with integer operations (the same bits
on every backend): the casts to custom floats (`float_cast`; CPD's and QPyTorch's casts in
`compat`), block floating point (`bfp`), OCP microscaling (`mx`), NVFP4 (`nvfp4`), block-scaled
FP8 (`block_scaled`), ordered sums with rounded intermediates (`sums`), the random bits of
stochastic rounding (`random_bits`), IEEE float32 add, multiply and divide (`ieee_f32`) and the
bit-packing layout (`packing`). `jlp.quantize` is the differentiable entry point to all of them.
"""
