// Native twin of rhyme_sglang/core/pytree.py: a bounded-depth weighted suffix trie.
// Semantics, tie-breaking and floating-point evaluation order match the Python reference exactly
// (the parity test compares drafts bit for bit). Build with -ffp-contract=off.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t NIL = -1;
constexpr uint64_t EMPTY = ~0ull;
constexpr uint64_t TOMB = ~1ull;

struct Node {
  int32_t token;
  int32_t count;
  int32_t first_child;
  int32_t next_sib;
  int32_t prev_sib;
  int32_t parent;
  int64_t weight;
};

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// Token sequence view over a Python buffer (int32 / int64) or any sequence of ints.
struct Tokens {
  std::vector<int32_t> owned;
  const int32_t* data = nullptr;
  size_t size = 0;
  explicit Tokens(const py::handle& obj) {
    if (PyObject_CheckBuffer(obj.ptr())) {
      py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
      if (info.ndim == 1 && info.itemsize == 4 && info.strides[0] == 4 &&
          (info.format == "i" || info.format == "<i" || info.format == "=i" || info.format == "l")) {
        data = static_cast<const int32_t*>(info.ptr);
        size = static_cast<size_t>(info.shape[0]);
        return;
      }
    }
    for (auto item : obj) owned.push_back(item.cast<int32_t>());
    data = owned.data();
    size = owned.size();
  }
};

class SuffixTrie {
 public:
  explicit SuffixTrie(int max_depth) : depth_(max_depth) {
    if (max_depth < 1) throw std::invalid_argument("max_depth must be >= 1");
    clear();
  }

  int max_depth() const { return depth_; }
  int64_t num_nodes() const { return num_nodes_; }

  void clear() {
    nodes_.assign(1, Node{0, 0, NIL, NIL, NIL, NIL, 0});
    free_.clear();
    keys_.assign(1024, EMPTY);
    vals_.assign(1024, NIL);
    used_ = tombs_ = 0;
    num_nodes_ = 0;
  }

  void update(const py::handle& seq_obj, int64_t lo, int64_t dcount, int64_t dweight) {
    Tokens seq(seq_obj);
    const int64_t n = static_cast<int64_t>(seq.size);
    for (int64_t i = std::max<int64_t>(0, lo - depth_ + 1); i < n; ++i) {
      int32_t node = 0;
      const int64_t end = std::min<int64_t>(n, i + depth_);
      for (int64_t j = i; j < end; ++j) {
        const int32_t tok = seq.data[j];
        int32_t child = find(node, tok);
        if (child == NIL) {
          if (dcount <= 0 || j < lo)
            throw std::invalid_argument("sequence is not stored: missing token " +
                                        std::to_string(tok) + " at offset " + std::to_string(j));
          child = create(node, tok);
        }
        if (j >= lo) {
          Node& c = nodes_[child];
          c.count += static_cast<int32_t>(dcount);
          c.weight += dweight;
          if (c.count <= 0) {
            if (c.count < 0 || c.weight != 0)
              throw std::invalid_argument("removal does not match a stored sequence");
            remove_subtree(child);
            break;
          }
        }
        node = child;
      }
    }
  }

  std::pair<int64_t, int64_t> lookup(const py::handle& path_obj) const {
    Tokens path(path_obj);
    int32_t node = 0;
    for (size_t i = 0; i < path.size; ++i) {
      node = find(node, path.data[i]);
      if (node == NIL) return {0, 0};
    }
    return {nodes_[node].count, nodes_[node].weight};
  }

  struct Raw {
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs;
    double score = 0.0;
    int match_len = 0;
  };

  py::tuple draft(const py::handle& ctx_obj, int max_pattern, int budget, double min_prob,
                  int max_branch, double prior) const {
    Tokens ctx(ctx_obj);
    Raw r = draft_raw(ctx, max_pattern, budget, min_prob, max_branch, prior);
    return py::make_tuple(r.tokens, r.parents, r.probs, r.score, r.match_len);
  }

  Raw draft_raw(const Tokens& ctx, int max_pattern, int budget, double min_prob, int max_branch,
                double prior) const {
    const int64_t n = static_cast<int64_t>(ctx.size);
    int32_t best = NIL;
    int match_len = 0;
    const int64_t mmax = std::min<int64_t>(std::min<int64_t>(max_pattern, n), depth_ - 1);
    for (int64_t m = 1; m <= mmax; ++m) {
      int32_t node = 0;
      for (int64_t j = n - m; j < n && node != NIL; ++j) node = find(node, ctx.data[j]);
      if (node == NIL) break;
      if (nodes_[node].first_child != NIL) {
        best = node;
        match_len = static_cast<int>(m);
      }
    }
    Raw out;
    std::vector<int32_t>& tokens = out.tokens;
    std::vector<int32_t>& parents = out.parents;
    std::vector<double>& probs = out.probs;
    if (best == NIL || budget <= 0) return out;
    std::priority_queue<Cand, std::vector<Cand>, CandLess> heap;
    int64_t seq_no = 0;
    std::vector<int32_t> top;
    auto push = [&](int32_t node, int32_t parent_idx, double base) {
      int64_t total = 0, support = 0;
      for (int32_t c = nodes_[node].first_child; c != NIL; c = nodes_[c].next_sib) {
        total += nodes_[c].weight;
        support += nodes_[c].count;
      }
      const double conf = static_cast<double>(support) / (static_cast<double>(support) + prior);
      top_children(node, max_branch, top);
      for (int32_t c : top) {
        const double cond = static_cast<double>(nodes_[c].weight) / static_cast<double>(total) * conf;
        heap.push(Cand{base * cond, seq_no++, c, parent_idx});
      }
    };
    push(best, -1, 1.0);
    double score = 0.0;
    while (!heap.empty() && static_cast<int>(tokens.size()) < budget) {
      Cand cand = heap.top();
      heap.pop();
      if (cand.prob < min_prob) break;
      tokens.push_back(nodes_[cand.node].token);
      parents.push_back(cand.parent);
      probs.push_back(cand.prob);
      score += cand.prob;
      if (nodes_[cand.node].first_child != NIL)
        push(cand.node, static_cast<int32_t>(tokens.size()) - 1, cand.prob);
    }
    out.score = score;
    out.match_len = match_len;
    return out;
  }

  // Bytes the live nodes need (node record + edge-table share at the nominal load); freed nodes
  // are reused by later inserts, so this is what eviction can reclaim.
  int64_t estimate_memory() const {
    return 128 + num_nodes_ * static_cast<int64_t>(sizeof(Node) + 24);
  }

  bool check_integrity() const {
    int64_t live = 0;
    std::vector<std::pair<int32_t, int>> stack{{0, 0}};
    while (!stack.empty()) {
      auto [node, d] = stack.back();
      stack.pop_back();
      if (d > depth_) return false;
      int64_t csum = 0, wsum = 0;
      for (int32_t c = nodes_[node].first_child; c != NIL; c = nodes_[c].next_sib) {
        const Node& cn = nodes_[c];
        if (cn.count <= 0 || cn.weight <= 0 || cn.parent != node) return false;
        if (find(node, cn.token) != c || find_hashed(node, cn.token) != c) return false;
        if (cn.next_sib != NIL && nodes_[cn.next_sib].prev_sib != c) return false;
        csum += cn.count;
        wsum += cn.weight;
        ++live;
        stack.push_back({c, d + 1});
      }
      if (node != 0 && (csum > nodes_[node].count || wsum > nodes_[node].weight)) return false;
    }
    return live == num_nodes_ && static_cast<int64_t>(used_) == num_nodes_;
  }

 private:
  struct Cand {
    double prob;
    int64_t seq;
    int32_t node;
    int32_t parent;
  };
  struct CandLess {  // max-heap on prob, then min on push order (as Python's heapq tuples)
    bool operator()(const Cand& a, const Cand& b) const {
      return a.prob < b.prob || (a.prob == b.prob && a.seq > b.seq);
    }
  };

  static uint64_t key_of(int32_t parent, int32_t tok) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(tok);
  }

  // Short sibling lists are scanned directly (most suffix-trie nodes have one or two children);
  // the edge hash table answers for wide nodes.
  int32_t find(int32_t parent, int32_t tok) const {
    int32_t c = nodes_[parent].first_child;
    for (int i = 0; i < 4; ++i) {
      if (c == NIL) return NIL;
      if (nodes_[c].token == tok) return c;
      c = nodes_[c].next_sib;
    }
    if (c == NIL) return NIL;
    return find_hashed(parent, tok);
  }

  int32_t find_hashed(int32_t parent, int32_t tok) const {
    const uint64_t key = key_of(parent, tok);
    size_t mask = keys_.size() - 1, h = mix64(key) & mask;
    while (true) {
      const uint64_t k = keys_[h];
      if (k == key) return vals_[h];
      if (k == EMPTY) return NIL;
      h = (h + 1) & mask;
    }
  }

  void insert_edge(uint64_t key, int32_t val) {
    size_t mask = keys_.size() - 1, h = mix64(key) & mask;
    while (keys_[h] != EMPTY && keys_[h] != TOMB) h = (h + 1) & mask;
    if (keys_[h] == TOMB) --tombs_;
    keys_[h] = key;
    vals_[h] = val;
    ++used_;
  }

  void erase_edge(uint64_t key) {
    size_t mask = keys_.size() - 1, h = mix64(key) & mask;
    while (keys_[h] != key) h = (h + 1) & mask;
    keys_[h] = TOMB;
    --used_;
    ++tombs_;
  }

  void maybe_rehash() {
    if ((used_ + tombs_ + 1) * 10 <= keys_.size() * 7) return;  // load factor <= 0.7
    size_t cap = keys_.size();
    while ((used_ + 1) * 20 > cap * 7) cap *= 2;  // at most 0.35 right after a rehash
    std::vector<uint64_t> old_keys(cap, EMPTY);
    std::vector<int32_t> old_vals(cap, NIL);
    old_keys.swap(keys_);
    old_vals.swap(vals_);
    used_ = tombs_ = 0;
    for (size_t i = 0; i < old_keys.size(); ++i)
      if (old_keys[i] != EMPTY && old_keys[i] != TOMB) insert_edge(old_keys[i], old_vals[i]);
  }

  int32_t create(int32_t parent, int32_t tok) {
    maybe_rehash();
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      if (nodes_.size() >= 0x7fffffff) throw std::length_error("suffix trie is full");
      id = static_cast<int32_t>(nodes_.size());
      nodes_.push_back(Node{});
    }
    Node& nd = nodes_[id];
    nd = Node{tok, 0, NIL, nodes_[parent].first_child, NIL, parent, 0};
    if (nd.next_sib != NIL) nodes_[nd.next_sib].prev_sib = id;
    nodes_[parent].first_child = id;
    insert_edge(key_of(parent, tok), id);
    ++num_nodes_;
    return id;
  }

  void remove_subtree(int32_t top) {
    Node& t = nodes_[top];
    if (t.prev_sib != NIL) nodes_[t.prev_sib].next_sib = t.next_sib;
    else nodes_[t.parent].first_child = t.next_sib;
    if (t.next_sib != NIL) nodes_[t.next_sib].prev_sib = t.prev_sib;
    std::vector<int32_t> stack{top};
    while (!stack.empty()) {
      int32_t id = stack.back();
      stack.pop_back();
      for (int32_t c = nodes_[id].first_child; c != NIL; c = nodes_[c].next_sib) stack.push_back(c);
      erase_edge(key_of(nodes_[id].parent, nodes_[id].token));
      nodes_[id] = Node{0, 0, NIL, NIL, NIL, NIL, 0};
      free_.push_back(id);
      --num_nodes_;
    }
  }

  // The `k` children ranked first by (weight desc, token asc), in that order.
  void top_children(int32_t node, int k, std::vector<int32_t>& out) const {
    out.clear();
    auto better = [&](int32_t a, int32_t b) {
      const Node& x = nodes_[a];
      const Node& y = nodes_[b];
      return x.weight > y.weight || (x.weight == y.weight && x.token < y.token);
    };
    for (int32_t c = nodes_[node].first_child; c != NIL; c = nodes_[c].next_sib) {
      if (static_cast<int>(out.size()) < k) {
        out.insert(std::upper_bound(out.begin(), out.end(), c, better), c);
      } else if (better(c, out.back())) {
        out.pop_back();
        out.insert(std::upper_bound(out.begin(), out.end(), c, better), c);
      }
    }
  }

  int depth_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;
  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  size_t used_ = 0, tombs_ = 0;
  int64_t num_nodes_ = 0;
};

// Twin of combine.mix_draft_py: each trie drafts 2*budget nodes (min_prob 0); path probabilities
// are mixed with normalised weights and the best `budget` paths form the tree.
py::tuple mix_draft(const std::vector<SuffixTrie*>& tries, const std::vector<double>& weights,
                    const py::handle& ctx_obj, int max_pattern, int budget, double min_prob,
                    int max_branch, double prior) {
  if (tries.size() != weights.size()) throw std::invalid_argument("tries and weights differ in length");
  Tokens ctx(ctx_obj);
  std::vector<SuffixTrie::Raw> raws;
  std::vector<double> ws;
  int match_len = 0, used = 0;
  for (size_t i = 0; i < tries.size(); ++i) {
    if (tries[i] == nullptr || weights[i] <= 0) continue;
    SuffixTrie::Raw r = tries[i]->draft_raw(ctx, max_pattern, 2 * budget, 0.0, max_branch, prior);
    if (r.tokens.empty()) continue;
    match_len = std::max(match_len, r.match_len);
    used |= 1 << i;
    raws.push_back(std::move(r));
    ws.push_back(weights[i]);
  }
  std::vector<int32_t> tokens, parents;
  std::vector<double> probs;
  double score = 0.0;
  if (raws.empty()) return py::make_tuple(tokens, parents, probs, 0.0, 0, 0);
  double total = 0.0;
  for (double w : ws) total += w;
  // Merge the drafts into one small trie; mixed[i] accumulates sum_s w_s * P_s(path_i).
  struct M {
    int32_t tok, parent, depth;
    double p;
  };
  std::vector<M> merged;
  size_t cap = 16;
  size_t num = 0;
  for (auto& r : raws) num += r.tokens.size();
  while (cap < 4 * num) cap *= 2;
  std::vector<uint64_t> keys(cap, EMPTY);
  std::vector<int32_t> vals(cap, NIL);
  auto find_or_add = [&](int32_t parent, int32_t tok) -> int32_t {
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) |
                         static_cast<uint32_t>(tok);
    size_t h = mix64(key) & (cap - 1);
    while (keys[h] != EMPTY) {
      if (keys[h] == key) return vals[h];
      h = (h + 1) & (cap - 1);
    }
    keys[h] = key;
    vals[h] = static_cast<int32_t>(merged.size());
    const int32_t depth = parent >= 0 ? merged[parent].depth + 1 : 1;
    merged.push_back(M{tok, parent, depth, 0.0});
    return vals[h];
  };
  std::vector<int32_t> local;
  for (size_t s = 0; s < raws.size(); ++s) {
    const double w = ws[s] / total;
    local.assign(raws[s].tokens.size(), NIL);
    for (size_t i = 0; i < raws[s].tokens.size(); ++i) {
      const int32_t par = raws[s].parents[i];
      const int32_t id = find_or_add(par >= 0 ? local[par] : NIL, raws[s].tokens[i]);
      merged[id].p = merged[id].p + w * raws[s].probs[i];
      local[i] = id;
    }
  }
  auto path_of = [&](int32_t id) {
    std::vector<int32_t> path;
    for (; id != NIL; id = merged[id].parent) path.push_back(merged[id].tok);
    std::reverse(path.begin(), path.end());
    return path;
  };
  std::vector<int32_t> order(merged.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (merged[a].p != merged[b].p) return merged[a].p > merged[b].p;
    if (merged[a].depth != merged[b].depth) return merged[a].depth < merged[b].depth;
    return path_of(a) < path_of(b);
  });
  std::vector<int32_t> out_index(merged.size(), NIL);
  for (int32_t id : order) {
    const M& m = merged[id];
    if (static_cast<int>(tokens.size()) >= budget || m.p < min_prob) break;
    int32_t parent = -1;
    if (m.parent != NIL) {
      parent = out_index[m.parent];
      if (parent == NIL) continue;
    }
    out_index[id] = static_cast<int32_t>(tokens.size());
    tokens.push_back(m.tok);
    parents.push_back(parent);
    probs.push_back(m.p);
    score += m.p;
  }
  return py::make_tuple(tokens, parents, probs, score, match_len, used);
}

}  // namespace

PYBIND11_MODULE(_rhyme_native, m) {
  m.doc() = "Native bounded-depth weighted suffix trie (twin of rhyme_sglang.core.pytree)";
  py::class_<SuffixTrie>(m, "SuffixTrie")
      .def(py::init<int>(), py::arg("max_depth"))
      .def_property_readonly("max_depth", &SuffixTrie::max_depth)
      .def_property_readonly("num_nodes", &SuffixTrie::num_nodes)
      .def("clear", &SuffixTrie::clear)
      .def("update", &SuffixTrie::update, py::arg("seq"), py::arg("lo"), py::arg("dcount"),
           py::arg("dweight"))
      .def("lookup", &SuffixTrie::lookup, py::arg("path"))
      .def("draft", &SuffixTrie::draft, py::arg("context"), py::arg("max_pattern"),
           py::arg("budget"), py::arg("min_prob"), py::arg("max_branch"), py::arg("prior") = 0.0)
      .def("estimate_memory", &SuffixTrie::estimate_memory)
      .def("check_integrity", &SuffixTrie::check_integrity);
  m.def("mix_draft", &mix_draft, py::arg("tries"), py::arg("weights"), py::arg("context"),
        py::arg("max_pattern"), py::arg("budget"), py::arg("min_prob"), py::arg("max_branch"),
        py::arg("prior"));
}
