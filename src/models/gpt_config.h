// The nanochat GPT: its configuration, sizing from depth, and the table of its parameters
// (names and shapes exactly as nanochat's state_dict) that everything else is derived from.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fp8t {

struct GptConfig {
  int n_layer = 12;
  int n_embd = 768;
  int n_head = 6;
  int n_kv_head = 6;
  int vocab_size = 32768;  // before padding
  int sequence_len = 2048;
  std::string window_pattern = "SSSL";  // tiled over layers; the last layer is always L
  int pad_vocab_to = 64;
  int short_window = 0;  // S layers' window; 0: nanochat's ceil(ceil(T / 4) / 128) * 128

  // nanochat's sizing: n_embd = ceil(depth * 64 / 128) * 128, heads of 128.
  static GptConfig from_depth(int depth);

  int head_dim() const { return n_embd / n_head; }
  int kv_dim() const { return n_kv_head * head_dim(); }
  int padded_vocab() const { return (vocab_size + pad_vocab_to - 1) / pad_vocab_to * pad_vocab_to; }
  // Layers with a value embedding alternate, the last layer always has one.
  bool has_value_embedding(int layer) const { return layer % 2 == (n_layer - 1) % 2; }
  // Left attention window of a layer: query t sees keys t - window .. t. L = sequence_len,
  // S = short_window or ceil(ceil(sequence_len / 4) / 128) * 128; the last layer is always L.
  int window(int layer) const;
  int backout_layer() const { return n_layer / 2; }  // its output is remembered for backout
  // The attention's softmax scale: nanochat multiplies the normed q and k by 1.2 each, folded
  // in here, over sqrt(head_dim).
  float attention_scale() const;

  // Throws ConfigError naming the field when the configuration is inconsistent.
  void validate() const;
};

inline constexpr int kSmearGateChannels = 24;
inline constexpr int kValueGateChannels = 12;

// What a parameter is, for optimizer groups, initialization and the precision policy.
enum class ParamKind : uint8_t {
  Embedding,    // transformer.wte, value_embeds.*: bf16 storage in nanochat
  BlockLinear,  // c_q, c_k, c_v, c_proj, c_fc, mlp c_proj
  Gate,         // ve_gate, smear_gate
  LmHead,       // lm_head
  Scalar,       // resid_lambdas, x0_lambdas, smear_lambda, backout_lambda
};

struct ParamSpec {
  std::string name;            // nanochat state_dict name
  std::vector<int64_t> shape;  // [out, in] for linears
  ParamKind kind;
  int layer = -1;  // block index, -1 outside blocks

  int64_t numel() const;
};

// Throws ConfigError naming tensor_model_parallel_size unless `size` ranks can split the query
// heads, the kv heads and the MLP's hidden features evenly.
void check_tensor_parallel(const GptConfig& config, int size);

enum class TensorSplit : uint8_t;  // models/tensor_parallel.h
// How tensor parallelism splits a linear (by name): q, k, v and the MLP's first linear by
// outputs, the attention's and the MLP's output projections by inputs, the rest not at all.
TensorSplit gpt_tensor_split(std::string_view linear);
// How tensor parallelism splits a parameter over the group, each rank holding and computing
// the gradient of its share only: the blocks' linears as gpt_tensor_split, the value gates' rows
// (Outputs) and the value embeddings' columns (Inputs) of each rank's kv heads; None for the
// rest.
TensorSplit gpt_parameter_split(const ParamSpec& spec);
// Whether sequence parallelism leaves each rank the gradient of a whole parameter from its own
// rows only, to be summed over the group: lm_head and the residual scalars (resid_lambdas,
// x0_lambdas, backout_lambda). The embedding and the smear run on every row.
bool gpt_sequence_split_gradient(const ParamSpec& spec);

// Every parameter, in nanochat's state_dict order.
std::vector<ParamSpec> gpt_parameters(const GptConfig& config);

// The parameter of `specs` named `name`; null when there is none.
const ParamSpec* find_parameter(const std::vector<ParamSpec>& specs, std::string_view name);

// Where in the backward a parameter's gradient is complete: 0 for lm_head, 1 + k for the block
// n_layer − 1 − k (a value embedding counts with its block), 1 + n_layer for the parameters
// outside the blocks, whose gradients the backward finishes last.
int backward_gradient_group(const ParamSpec& spec, int n_layer);

// A linear layer (y = x W^T): the candidates of the FP8 precision policy.
struct LinearSpec {
  std::string name;  // parameter name without ".weight"
  int64_t in_features;
  int64_t out_features;
  ParamKind kind;  // BlockLinear, Gate or LmHead
  int layer = -1;
};

std::vector<LinearSpec> gpt_linears(const GptConfig& config);

// nanochat's FLOPs per token (forward + backward): 6 x matmul parameters (lm_head included,
// embeddings and scalars not) + sum over layers of 12 * heads * head_dim * min(window, T).
double gpt_flops_per_token(const GptConfig& config);

}  // namespace fp8t
