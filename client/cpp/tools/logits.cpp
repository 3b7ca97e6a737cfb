// expertd-cpp-logits ENDPOINT MODULE IDS OUT [--refresh-on-stdin]
//
// Run a TorchScript model on the daemon's shared memory from C++: attach with the C++ client, load MODULE (a
// `torch.jit.save`d model whose parameters carry the served names, e.g. a traced transformers model wrapped as
// `m`), bind every parameter to the served tensor of its name (the read-only mapped view itself: no copy), run
// it on the token ids IDS (comma-separated, one sequence) and write the logits' raw bytes to OUT.0. It prints
// "bound N of M" (N parameters bound to shared memory, their data pointers the views') and the logits' dtype and
// shape.
// --refresh-on-stdin: then wait for a line on stdin (a push has made a newer generation), refresh, bind the new
// views, run again into OUT.1; then bind the views taken before the refresh (still mapped: the old generation's
// bytes) and run into OUT.2.
// Exit status: 0 ok, 2 usage, 1 a parameter the daemon does not serve (named on stderr) or any other error.
#include <torch/script.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "expertd/client.h"

namespace {

int usage(const char* why) {
  std::fprintf(stderr, "expertd-cpp-logits: %s\nusage: expertd-cpp-logits ENDPOINT MODULE IDS OUT [--refresh-on-stdin]\n",
               why);
  return 2;
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) ids.push_back(std::stoll(item));
  return ids;
}

// Bind every parameter of `module` to the tensor of its name in `views` (the module's own prefix, e.g. "m.", taken
// off); returns how many were bound. Throws std::out_of_range naming a parameter `views` lacks.
size_t bind_views(torch::jit::Module& module, const expertd::TensorMap& views) {
  size_t bound = 0;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    const std::string name = p.name.substr(p.name.find('.') + 1);  // the wrapper's attribute first
    auto found = views.find(name);
    if (found == views.end()) throw std::out_of_range("the daemon serves no tensor " + name);
    at::Tensor param = p.value;
    param.set_data(found->second);
    if (param.data_ptr() != found->second.data_ptr()) throw std::runtime_error(name + ": not bound to its view");
    ++bound;
  }
  return bound;
}

void run(torch::jit::Module& module, const at::Tensor& ids, const std::string& path) {
  at::Tensor logits = module.forward({ids}).toTensor().contiguous();
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(logits.data_ptr()), static_cast<std::streamsize>(logits.nbytes()));
  if (!out) throw std::runtime_error("cannot write " + path);
  std::cout << path << " " << expertd::dtype_name(logits.scalar_type()) << " " << logits.sizes() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) return usage("four arguments expected");
  const std::string endpoint = argv[1], module_path = argv[2], out = argv[4];
  bool refresh = false;
  for (int i = 5; i < argc; ++i) {
    if (std::string(argv[i]) == "--refresh-on-stdin") refresh = true;
    else return usage((std::string("unknown option ") + argv[i]).c_str());
  }
  try {
    c10::InferenceMode guard;
    torch::jit::Module module = torch::jit::load(module_path);
    module.eval();
    const std::vector<int64_t> values = parse_ids(argv[3]);
    at::Tensor ids = torch::tensor(values, torch::kLong).unsqueeze(0);
    expertd::Client client(endpoint);
    expertd::Lease lease = client.attach();
    expertd::TensorMap before = lease.tensors();
    size_t total = module.named_parameters(true).size();
    std::cout << "generation " << lease.generation() << " bound " << bind_views(module, before) << " of " << total
              << std::endl;
    run(module, ids, out + ".0");
    if (refresh) {
      std::string line;
      std::getline(std::cin, line);
      std::vector<std::string> changed = lease.refresh();
      std::cout << "generation " << lease.generation() << " changed " << changed.size() << " bound "
                << bind_views(module, lease.tensors()) << " of " << total << std::endl;
      run(module, ids, out + ".1");
      bind_views(module, before);
      run(module, ids, out + ".2");
    }
    lease.release();
    return 0;
  } catch (const std::exception& exc) {
    std::cerr << "expertd-cpp-logits: " << exc.what() << std::endl;
    return 1;
  }
}
