"""Optional: ops written by hand in CUDA C++, to compare with their Triton kernels. Each is built on first use
by ``torch.utils.cpp_extension.load_inline`` (needs a CUDA GPU, nvcc and ninja); nothing else imports them
unless a config asks for them (``model.mlp_block`` "cuda_bias_act")."""
