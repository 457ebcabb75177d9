// Native twin of rhyme_sglang/core/pytree.py: a bounded-depth weighted suffix trie.
// Semantics, tie-breaking and floating-point evaluation order match the Python reference exactly
// (the parity test compares drafts bit for bit). Build with -ffp-contract=off.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
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

// An explicit trie node. A node may instead end in a *tail*: an implicit unary chain of
// `tail_len` descendants spelling `tail_len` tokens of a stored block from `tail_pos`, each with
// count `tail_count` and weight `tail_weight` (the occurrences that continue through the chain all
// continue to its end). The long unary chains that dominate a bounded-depth suffix trie of real
// rollouts (86% of its nodes on the dev trace occur once) then cost one record instead of one per
// token. A node with a tail has no explicit children. The logical content (count and weight of
// every substring) is exactly that of the uncompressed Python twin.
struct Node {
  int32_t token;
  int32_t count;
  int32_t first_child;
  int32_t next_sib;
  int32_t prev_sib;
  int32_t parent;
  int64_t weight;
  int32_t tail_block;  // NIL = no tail
  int32_t tail_pos;
  int32_t tail_len;
  int32_t tail_count;
  int64_t tail_weight;
};

constexpr Node EMPTY_NODE{0, 0, NIL, NIL, NIL, NIL, 0, NIL, 0, 0, 0, 0};

// A logical position: explicit node `node` (off == 0) or its tail's off-th implicit descendant.
struct Pos {
  int32_t node;
  int32_t off;
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
  // Logical nodes (explicit + implicit), as the uncompressed Python twin counts them.
  int64_t num_nodes() const { return explicit_ + implicit_; }
  int64_t num_explicit() const { return explicit_; }

  void clear() {
    nodes_.assign(1, EMPTY_NODE);
    free_.clear();
    keys_.assign(1024, EMPTY);
    vals_.assign(1024, NIL);
    used_ = tombs_ = 0;
    explicit_ = implicit_ = 0;
    blocks_.clear();
    block_refs_.clear();
    free_blocks_.clear();
    block_tokens_ = 0;
    streaming_.clear();
    num_streams_ = 0;
  }

  // ---- changing the stored multiset: insert, extend, reweight, remove (one function each)
  //
  // Every stored occurrence of a sequence adds count 1 and its integer weight to each of its
  // substrings of length <= max_depth. New continuations become tails over a block of tokens.

  // Store one more occurrence of `seq` with `weight` (> 0).
  void insert(const py::handle& seq_obj, int64_t weight) {
    Tokens seq(seq_obj);
    check_weight(weight);
    add(seq, 0, weight, NIL);
  }

  // `seq[:lo]` is stored with `weight`; store the rest: the substrings ending at `lo` or later
  // (a response that grew). With `stream` (a handle from `open_stream` whose block holds exactly
  // `seq[:lo]`) the new tokens join the stream's block, and a tail that ends where the stream
  // ended and carries only its occurrence is lengthened in place instead of being turned into
  // explicit nodes, so a growing sequence is as compact as one inserted whole. The logical
  // content is the same with or without a stream.
  void extend(const py::handle& seq_obj, int64_t lo, int64_t weight, int64_t stream) {
    Tokens seq(seq_obj);
    check_weight(weight);
    const int64_t n = static_cast<int64_t>(seq.size);
    if (lo < 0 || lo > n)
      throw std::invalid_argument("lo must be in [0, len(seq)], got " + std::to_string(lo));
    int32_t block = NIL;
    if (stream != NIL) {
      block = open_block(stream);
      std::vector<int32_t>& b = blocks_[block];
      if (static_cast<int64_t>(b.size()) != lo || (lo > 0 && b.back() != seq.data[lo - 1]))
        throw std::invalid_argument("stream " + std::to_string(stream) + " holds " +
                                    std::to_string(b.size()) + " tokens, not seq[:lo] with lo=" +
                                    std::to_string(lo));
      b.insert(b.end(), seq.data + lo, seq.data + n);
      block_tokens_ += n - lo;
    }
    add(seq, lo, weight, block);
  }

  // Insert `seq` with `weight` as a sequence that will grow: its tokens go to a block of their
  // own that `extend(..., stream=handle)` appends to. Returns the handle; the caller owns it and
  // gives it back with `close_stream` when the sequence stops growing.
  int64_t open_stream(const py::handle& seq_obj, int64_t weight) {
    Tokens seq(seq_obj);
    check_weight(weight);
    const int32_t block = new_block(seq.data, static_cast<int64_t>(seq.size));
    ++block_refs_[block];  // the stream's reference
    streaming_[block] = 1;
    ++num_streams_;
    add(seq, 0, weight, block);
    return block;
  }

  // The sequence of `stream` stops growing (it stays stored); the handle becomes invalid.
  void close_stream(int64_t stream) {
    const int32_t block = open_block(stream);
    streaming_[block] = 0;
    --num_streams_;
    release_block(block);
  }

  int64_t num_streams() const { return num_streams_; }

  // Add `dweight` to the weight of a stored occurrence of `seq` (its count is unchanged).
  void reweight(const py::handle& seq_obj, int64_t dweight) {
    Tokens seq(seq_obj);
    walk_stored(
        seq,
        [&](int32_t c) {
          nodes_[c].weight += dweight;
          return true;
        },
        [&](int32_t node) { nodes_[node].tail_weight += dweight; });
  }

  // Remove a stored occurrence of `seq` with `weight`; nodes no occurrence reaches any more go.
  void remove(const py::handle& seq_obj, int64_t weight) {
    Tokens seq(seq_obj);
    check_weight(weight);
    walk_stored(
        seq,
        [&](int32_t c) {
          Node& x = nodes_[c];
          x.count -= 1;
          x.weight -= weight;
          if (x.count > 0) return true;
          if (x.weight != 0) throw mismatch();
          remove_subtree(c);
          return false;
        },
        [&](int32_t node) {
          Node& x = nodes_[node];
          x.tail_count -= 1;
          x.tail_weight -= weight;
          if (x.tail_count > 0) return;
          if (x.tail_weight != 0) throw mismatch();
          drop_tail(node);
        });
  }

  std::pair<int64_t, int64_t> lookup(const py::handle& path_obj) const {
    Tokens path(path_obj);
    Pos p{0, 0};
    for (size_t i = 0; i < path.size; ++i)
      if (!step(p, path.data[i])) return {0, 0};
    if (p.off > 0) return {nodes_[p.node].tail_count, nodes_[p.node].tail_weight};
    return {nodes_[p.node].count, nodes_[p.node].weight};
  }

  struct Raw {
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs;
    double score = 0.0;
    int match_len = 0;
  };

  py::tuple draft(const py::handle& ctx_obj, int max_pattern, int budget, double min_prob,
                  int max_branch, double prior, double prior_decay) const {
    Tokens ctx(ctx_obj);
    Raw r = draft_raw(ctx, max_pattern, budget, min_prob, max_branch, prior, prior_decay);
    return py::make_tuple(r.tokens, r.parents, r.probs, r.score, r.match_len);
  }

  // A child's conditional probability is its weight share times C / (C + prior * decay^L), where
  // C = occurrences continuing past the parent and L = tokens the parent spells (matched context
  // plus draft path): one occurrence after a long context is stronger evidence than after a short.
  Raw draft_raw(const Tokens& ctx, int max_pattern, int budget, double min_prob, int max_branch,
                double prior, double prior_decay) const {
    const int64_t n = static_cast<int64_t>(ctx.size);
    Pos best{NIL, 0};
    int match_len = 0;
    const int64_t mmax = std::min<int64_t>(std::min<int64_t>(max_pattern, n), depth_ - 1);
    for (int64_t m = 1; m <= mmax; ++m) {
      Pos p{0, 0};
      bool ok = true;
      for (int64_t j = n - m; j < n && ok; ++j) ok = step(p, ctx.data[j]);
      if (!ok) break;
      if (has_children(p)) {
        best = p;
        match_len = static_cast<int>(m);
      }
    }
    Raw out;
    std::vector<int32_t>& tokens = out.tokens;
    std::vector<int32_t>& parents = out.parents;
    std::vector<double>& probs = out.probs;
    if (best.node == NIL || budget <= 0) return out;
    std::priority_queue<Cand, std::vector<Cand>, CandLess> heap;
    int64_t seq_no = 0;
    std::vector<int32_t> top;
    auto push = [&](Pos at, int32_t parent_idx, double base, int32_t len) {
      const double eff_prior = prior * std::pow(prior_decay, static_cast<double>(len));
      const Node& nd = nodes_[at.node];
      if (at.off > 0 || nd.tail_block != NIL) {  // one implicit child with all the weight
        const double support = static_cast<double>(nd.tail_count);
        const double conf = support / (support + eff_prior);
        const double cond = static_cast<double>(nd.tail_weight) / static_cast<double>(nd.tail_weight) * conf;
        heap.push(Cand{base * cond, seq_no++, Pos{at.node, at.off + 1}, parent_idx, len + 1});
        return;
      }
      int64_t total = 0, support = 0;
      for (int32_t c = nd.first_child; c != NIL; c = nodes_[c].next_sib) {
        total += nodes_[c].weight;
        support += nodes_[c].count;
      }
      const double conf = static_cast<double>(support) / (static_cast<double>(support) + eff_prior);
      top_children(at.node, max_branch, top);
      for (int32_t c : top) {
        const double cond = static_cast<double>(nodes_[c].weight) / static_cast<double>(total) * conf;
        heap.push(Cand{base * cond, seq_no++, Pos{c, 0}, parent_idx, len + 1});
      }
    };
    push(best, -1, 1.0, static_cast<int32_t>(match_len));
    double score = 0.0;
    while (!heap.empty() && static_cast<int>(tokens.size()) < budget) {
      Cand cand = heap.top();
      heap.pop();
      if (cand.prob < min_prob) break;
      tokens.push_back(token_at(cand.at));
      parents.push_back(cand.parent);
      probs.push_back(cand.prob);
      score += cand.prob;
      if (has_children(cand.at))
        push(cand.at, static_cast<int32_t>(tokens.size()) - 1, cand.prob, cand.len);
    }
    out.score = score;
    out.match_len = match_len;
    return out;
  }

  // Bytes the structure needs: explicit node records with their edge-table share (at the nominal
  // load) and the token blocks behind the tails; freed records are reused by later inserts.
  int64_t estimate_memory() const {
    return 128 + explicit_ * static_cast<int64_t>(sizeof(Node) + 24) +
           block_tokens_ * static_cast<int64_t>(sizeof(int32_t)) +
           static_cast<int64_t>(blocks_.size()) * 32;
  }

  bool check_integrity() const {
    int64_t live = 0, implicit = 0;
    std::vector<int64_t> refs(blocks_.size(), 0);
    std::vector<std::pair<int32_t, int>> stack{{0, 0}};
    while (!stack.empty()) {
      auto [node, d] = stack.back();
      stack.pop_back();
      if (d > depth_) return false;
      const Node& nd = nodes_[node];
      if (nd.tail_block != NIL) {
        if (node == 0 || nd.first_child != NIL || nd.tail_len < 1 || d + nd.tail_len > depth_) return false;
        if (nd.tail_block < 0 || nd.tail_block >= static_cast<int32_t>(blocks_.size())) return false;
        if (nd.tail_pos < 0 || nd.tail_pos + nd.tail_len > static_cast<int32_t>(blocks_[nd.tail_block].size()))
          return false;
        if (nd.tail_weight <= 0 || nd.tail_count < 1 || nd.tail_count > nd.count ||
            nd.tail_weight > nd.weight)
          return false;
        ++refs[nd.tail_block];
        implicit += nd.tail_len;
      }
      int64_t csum = 0, wsum = 0;
      for (int32_t c = nd.first_child; c != NIL; c = nodes_[c].next_sib) {
        const Node& cn = nodes_[c];
        if (cn.count <= 0 || cn.weight <= 0 || cn.parent != node) return false;
        if (find(node, cn.token) != c || find_hashed(node, cn.token) != c) return false;
        if (cn.next_sib != NIL && nodes_[cn.next_sib].prev_sib != c) return false;
        csum += cn.count;
        wsum += cn.weight;
        ++live;
        stack.push_back({c, d + 1});
      }
      if (node != 0 && (csum > nd.count || wsum > nd.weight)) return false;
    }
    int64_t streams = 0;
    for (size_t b = 0; b < blocks_.size(); ++b)
      if (streaming_[b]) {
        ++refs[b];
        ++streams;
      }
    if (streams != num_streams_) return false;
    for (size_t b = 0; b < blocks_.size(); ++b)
      if (refs[b] != block_refs_[b]) return false;
    return live == explicit_ && implicit == implicit_ && static_cast<int64_t>(used_) == explicit_;
  }

 private:
  struct Cand {
    double prob;
    int64_t seq;
    Pos at;
    int32_t parent;
    int32_t len;  // tokens the candidate's node spells
  };
  struct CandLess {  // max-heap on prob, then min on push order (as Python's heapq tuples)
    bool operator()(const Cand& a, const Cand& b) const {
      return a.prob < b.prob || (a.prob == b.prob && a.seq > b.seq);
    }
  };

  static void check_weight(int64_t weight) {
    if (weight <= 0) throw std::invalid_argument("weight must be > 0, got " + std::to_string(weight));
  }

  static std::invalid_argument mismatch() {
    return std::invalid_argument("removal does not match a stored sequence");
  }

  // The block of an open stream; ValueError for anything else.
  int32_t open_block(int64_t stream) const {
    if (stream < 0 || stream >= static_cast<int64_t>(streaming_.size()) || !streaming_[stream])
      throw std::invalid_argument("no open stream " + std::to_string(stream));
    return static_cast<int32_t>(stream);
  }

  // Add one occurrence of the substrings seq[i:j+1] with j >= lo, given that seq[:lo] is stored.
  // Tails point into `block` (holding all of seq when given, else created on first use holding
  // seq[lo:]); the call holds its own reference to it, so that a tail moved or dropped by a later
  // suffix cannot free it while other suffixes still attach to it.
  void add(const Tokens& seq, int64_t lo, int64_t weight, int32_t block) {
    const int64_t n = static_cast<int64_t>(seq.size);
    const bool growing = block != NIL;
    Occurrence occ{this, seq, lo, weight, block, growing ? 0 : lo};
    if (growing) ++block_refs_[block];
    for (int64_t i = std::max<int64_t>(0, lo - depth_ + 1); i < n; ++i) {
      const int64_t end = std::min<int64_t>(n, i + depth_);
      Pos p{0, 0};
      int64_t j = i;
      for (; j < lo; ++j)  // the part already stored
        if (!step(p, seq.data[j])) throw missing(seq.data[j], j);
      if (j >= end) continue;
      if (p.off > 0) {
        Node& x = nodes_[p.node];
        if (growing && p.off == x.tail_len && x.tail_block == block &&
            x.tail_pos + x.tail_len == lo && x.tail_count == 1 && x.tail_weight == weight) {
          // the stream's own occurrence, ending where the stream ended: lengthen the tail
          const int32_t more = static_cast<int32_t>(end - lo);
          x.tail_len += more;
          implicit_ += more;
          continue;
        }
        p = explicitize(p);
      }
      add_below(p.node, j, end, occ);
    }
  }

  // The occurrence an `add` call stores, and the block its new tails point into.
  struct Occurrence {
    SuffixTrie* trie;
    const Tokens& seq;
    int64_t lo, weight;
    int32_t block;  // holds seq[base:]; NIL until the first tail needs it
    int64_t base;
    ~Occurrence() {
      if (block != NIL) trie->release_block(block);
    }
    int32_t tail_block() {
      if (block == NIL) {
        block = trie->new_block(seq.data + lo, static_cast<int64_t>(seq.size) - lo);
        ++trie->block_refs_[block];
      }
      return block;
    }
  };

  // Add the occurrence's seq[j:end] below explicit node `node`, which spells seq[i:j].
  void add_below(int32_t node, int64_t j, int64_t end, Occurrence& occ) {
    const int32_t* toks = occ.seq.data;
    for (; j < end; ++j) {
      const int32_t tok = toks[j];
      Node& nd = nodes_[node];
      int32_t child;
      bool fresh = false;
      if (nd.tail_block != NIL) {
        if (end - j == nd.tail_len && tail_matches(nd, toks + j)) {
          nd.tail_count += 1;  // the same continuation again
          nd.tail_weight += occ.weight;
          return;
        }
        const bool same = blocks_[nd.tail_block][nd.tail_pos] == tok;
        child = materialize(node);
        if (!same) {
          child = create(node, tok);
          fresh = true;
        }
      } else if (nd.first_child == NIL && node != 0) {
        // a leaf: everything from here on is new and continues only this occurrence
        const int32_t block = occ.tail_block();
        attach_tail(node, block, static_cast<int32_t>(j - occ.base), static_cast<int32_t>(end - j),
                    1, occ.weight);
        return;
      } else {
        child = find(node, tok);
        if (child == NIL) {
          child = create(node, tok);
          fresh = true;
        }
      }
      Node& c = nodes_[child];
      c.count += 1;
      c.weight += occ.weight;
      if (fresh && j + 1 < end) {  // the rest of this occurrence is a tail
        const int32_t block = occ.tail_block();
        attach_tail(child, block, static_cast<int32_t>(j + 1 - occ.base),
                    static_cast<int32_t>(end - j - 1), 1, occ.weight);
        return;
      }
      node = child;
    }
  }

  // Visit the stored occurrence of every substring seq[i:j+1] (j - i < max_depth) once, from the
  // root: `on_node(child)` for each explicit node (false ends this suffix's walk, e.g. the node
  // was removed), `on_tail(node)` once where the walk reaches a tail (the occurrence spells it to
  // its end). Throws when seq is not stored.
  template <class OnNode, class OnTail>
  void walk_stored(const Tokens& seq, OnNode on_node, OnTail on_tail) {
    const int64_t n = static_cast<int64_t>(seq.size);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t end = std::min<int64_t>(n, i + depth_);
      int32_t node = 0;
      for (int64_t j = i; j < end; ++j) {
        const int32_t tok = seq.data[j];
        const Node& nd = nodes_[node];
        if (nd.tail_block != NIL) {
          if (blocks_[nd.tail_block][nd.tail_pos] != tok) throw missing(tok, j);
          if (end - j != nd.tail_len || !tail_matches(nd, seq.data + j)) throw mismatch();
          on_tail(node);
          break;
        }
        const int32_t child = find(node, tok);
        if (child == NIL) throw missing(tok, j);
        if (!on_node(child)) break;
        node = child;
      }
    }
  }

  static std::invalid_argument missing(int32_t tok, int64_t j) {
    return std::invalid_argument("sequence is not stored: missing token " + std::to_string(tok) +
                                 " at offset " + std::to_string(j));
  }

  static uint64_t key_of(int32_t parent, int32_t tok) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(tok);
  }

  int32_t token_at(Pos p) const {
    const Node& nd = nodes_[p.node];
    return p.off == 0 ? nd.token : blocks_[nd.tail_block][nd.tail_pos + p.off - 1];
  }

  bool has_children(Pos p) const {
    const Node& nd = nodes_[p.node];
    if (p.off > 0) return p.off < nd.tail_len;
    return nd.first_child != NIL || nd.tail_block != NIL;
  }

  // Move to the child spelling `tok`; false (p unchanged) when there is none.
  bool step(Pos& p, int32_t tok) const {
    const Node& nd = nodes_[p.node];
    if (p.off > 0 || nd.tail_block != NIL) {
      if (p.off >= nd.tail_len || blocks_[nd.tail_block][nd.tail_pos + p.off] != tok) return false;
      ++p.off;
      return true;
    }
    const int32_t c = find(p.node, tok);
    if (c == NIL) return false;
    p = Pos{c, 0};
    return true;
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
      nodes_.push_back(EMPTY_NODE);
    }
    Node& nd = nodes_[id];
    nd = EMPTY_NODE;
    nd.token = tok;
    nd.next_sib = nodes_[parent].first_child;
    nd.parent = parent;
    if (nd.next_sib != NIL) nodes_[nd.next_sib].prev_sib = id;
    nodes_[parent].first_child = id;
    insert_edge(key_of(parent, tok), id);
    ++explicit_;
    return id;
  }

  int32_t new_block(const int32_t* data, int64_t len) {
    int32_t id;
    if (!free_blocks_.empty()) {
      id = free_blocks_.back();
      free_blocks_.pop_back();
    } else {
      id = static_cast<int32_t>(blocks_.size());
      blocks_.emplace_back();
      block_refs_.push_back(0);
      streaming_.push_back(0);
    }
    blocks_[id].assign(data, data + len);
    block_tokens_ += len;
    return id;
  }

  bool tail_matches(const Node& nd, const int32_t* toks) const {
    const int32_t* t = blocks_[nd.tail_block].data() + nd.tail_pos;
    return std::equal(t, t + nd.tail_len, toks);
  }

  void attach_tail(int32_t node, int32_t block, int32_t pos, int32_t len, int32_t count,
                   int64_t weight) {
    Node& nd = nodes_[node];
    nd.tail_block = block;
    nd.tail_pos = pos;
    nd.tail_len = len;
    nd.tail_count = count;
    nd.tail_weight = weight;
    ++block_refs_[block];
    implicit_ += len;
  }

  void drop_tail(int32_t node) {
    Node& nd = nodes_[node];
    const int32_t b = nd.tail_block;
    implicit_ -= nd.tail_len;
    nd.tail_block = NIL;
    nd.tail_pos = nd.tail_len = nd.tail_count = 0;
    nd.tail_weight = 0;
    release_block(b);
  }

  void release_block(int32_t b) {
    if (--block_refs_[b] == 0) {
      block_tokens_ -= static_cast<int64_t>(blocks_[b].size());
      std::vector<int32_t>().swap(blocks_[b]);
      free_blocks_.push_back(b);
    }
  }

  // Turn the first implicit node of `node`'s tail into an explicit child; the rest of the tail
  // moves to that child (the block keeps its one reference). Returns the child.
  int32_t materialize(int32_t node) {
    const int32_t tok = blocks_[nodes_[node].tail_block][nodes_[node].tail_pos];
    const int32_t child = create(node, tok);  // may grow nodes_: take references only after
    Node& nd = nodes_[node];
    Node& ch = nodes_[child];
    ch.count = nd.tail_count;
    ch.weight = nd.tail_weight;
    if (nd.tail_len == 1) {
      drop_tail(node);
      return child;
    }
    ch.tail_block = nd.tail_block;
    ch.tail_pos = nd.tail_pos + 1;
    ch.tail_len = nd.tail_len - 1;
    ch.tail_count = nd.tail_count;
    ch.tail_weight = nd.tail_weight;
    --implicit_;  // one implicit node became the explicit child
    nd.tail_block = NIL;
    nd.tail_pos = nd.tail_len = nd.tail_count = 0;
    nd.tail_weight = 0;
    return child;
  }

  Pos explicitize(Pos p) {
    while (p.off > 0) {
      const int32_t child = materialize(p.node);
      p = Pos{child, p.off - 1};
    }
    return p;
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
      if (nodes_[id].tail_block != NIL) drop_tail(id);
      erase_edge(key_of(nodes_[id].parent, nodes_[id].token));
      nodes_[id] = EMPTY_NODE;
      free_.push_back(id);
      --explicit_;
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
  int64_t explicit_ = 0, implicit_ = 0;
  std::vector<std::vector<int32_t>> blocks_;
  std::vector<int64_t> block_refs_;
  std::vector<int32_t> free_blocks_;
  int64_t block_tokens_ = 0;
  std::vector<uint8_t> streaming_;  // per block: it is an open stream's (see open_stream)
  int64_t num_streams_ = 0;
};

// Twin of combine.mix_draft_py: each trie drafts 2*budget nodes (min_prob 0); path probabilities
// are mixed with normalised weights and the best `budget` paths form the tree.
py::tuple mix_draft(const std::vector<SuffixTrie*>& tries, const std::vector<double>& weights,
                    const py::handle& ctx_obj, int max_pattern, int budget, double min_prob,
                    int max_branch, double prior, double prior_decay) {
  if (tries.size() != weights.size()) throw std::invalid_argument("tries and weights differ in length");
  Tokens ctx(ctx_obj);
  std::vector<SuffixTrie::Raw> raws;
  std::vector<double> ws;
  int match_len = 0, used = 0;
  for (size_t i = 0; i < tries.size(); ++i) {
    if (tries[i] == nullptr || weights[i] <= 0) continue;
    SuffixTrie::Raw r = tries[i]->draft_raw(ctx, max_pattern, 2 * budget, 0.0, max_branch, prior,
                                               prior_decay);
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
      .def_property_readonly("num_explicit", &SuffixTrie::num_explicit)
      .def("clear", &SuffixTrie::clear)
      .def("insert", &SuffixTrie::insert, py::arg("seq"), py::arg("weight"))
      .def("extend", &SuffixTrie::extend, py::arg("seq"), py::arg("lo"), py::arg("weight"),
           py::arg("stream") = -1)
      .def("reweight", &SuffixTrie::reweight, py::arg("seq"), py::arg("dweight"))
      .def("remove", &SuffixTrie::remove, py::arg("seq"), py::arg("weight"))
      .def("open_stream", &SuffixTrie::open_stream, py::arg("seq"), py::arg("weight"))
      .def("close_stream", &SuffixTrie::close_stream, py::arg("stream"))
      .def_property_readonly("num_streams", &SuffixTrie::num_streams)
      .def("lookup", &SuffixTrie::lookup, py::arg("path"))
      .def("draft", &SuffixTrie::draft, py::arg("context"), py::arg("max_pattern"),
           py::arg("budget"), py::arg("min_prob"), py::arg("max_branch"), py::arg("prior") = 0.0,
           py::arg("prior_decay") = 1.0)
      .def("estimate_memory", &SuffixTrie::estimate_memory)
      .def("check_integrity", &SuffixTrie::check_integrity);
  m.def("mix_draft", &mix_draft, py::arg("tries"), py::arg("weights"), py::arg("context"),
        py::arg("max_pattern"), py::arg("budget"), py::arg("min_prob"), py::arg("max_branch"),
        py::arg("prior"), py::arg("prior_decay") = 1.0);
}
