// Lets one definition serve host code and CUDA device code.
#pragma once

#if defined(__CUDACC__)
#define FP8T_HD __host__ __device__
#else
#define FP8T_HD
#endif
