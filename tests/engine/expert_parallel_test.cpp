// `tandem engine --expert-parallel N` end to end: the same greedy tokens as the single-process
// engine on tiny-v3 and tiny-v2-lite with 2 and 4 ranks (concurrent requests, so mixed batches
// of prefill chunks and decodes; chunked prefill; preemption), float32 logprobs within 1e-5,
// redundant expert copies, a placement that does not fit refused, and failure handling: a rank
// killed with SIGKILL fails the requests in flight with OpenAI errors and makes /health answer
// 503, and no rank outlives its engine (the shared segment is a memfd, freed with them).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>

#include <fstream>
#include <future>
#include <map>
#include <optional>
#include <random>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/engine_http.h"
#include "engine/engine_process.h"
#include "engine/expert_parallel/ep_rank.h"
#include "net/http_client.h"
#include "text/oracle_support.h"
#include "util/thread_state.h"

namespace tandem::engine {
namespace {

using nlohmann::json;

// The pids whose parent is `parent`, from /proc.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  DIR* d = opendir("/proc");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
    if (pid <= 0) continue;
    const testing::ProcStat s = testing::read_proc_stat("/proc/" + std::to_string(pid) + "/stat");
    if (s.error == 0 && s.parent == parent && s.state != 'Z') out.push_back(pid);
  }
  closedir(d);
  return out;
}

// Running (not a zombie, not gone).
bool running(pid_t pid) {
  const testing::ProcStat s = testing::read_proc_stat("/proc/" + std::to_string(pid) + "/stat");
  return s.error == 0 && s.state != 'Z' && s.state != 'X';
}

std::vector<int32_t> prompt(int n, int base) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(base + (i * 7919) % 5000);
  return t;
}

// A placement in `tandem place`'s JSON: per layer, each rank's experts in slot order.
json placement_json(int ranks, int experts,
                    const std::vector<std::vector<std::vector<int>>>& layers) {
  json phy2log = json::array(), rank_slots = json::array();
  for (const auto& layer : layers) {
    json row = json::array(), counts = json::array();
    for (const auto& rank : layer) {
      counts.push_back(rank.size());
      for (int e : rank) row.push_back(e);
    }
    phy2log.push_back(row);
    rank_slots.push_back(counts);
  }
  return {{"format", "tandem-placement-v1"},
          {"ranks", ranks},
          {"experts", experts},
          {"phy2log", phy2log},
          {"rank_slots", rank_slots}};
}

// The planner (placement::evaluate) and the simulator give each copy of an expert an equal share
// of its tokens, so the ranks' dispatch must too, whichever ranks the tokens come from: with few
// sequences attention puts them all on rank 0, which must not then run every expert it holds a
// copy of. Per expert with c copies and t tokens in a layer's step, every copy gets floor(t/c) or
// ceil(t/c), and the same however the t tokens are spread over the senders.
TEST(ExpertDispatch, EveryCopyOfAnExpertGetsAnEvenShareOfItsTokensWhoeverSentThem) {
  // 3 ranks, 6 experts; slots rank-major. Expert 0 on every rank, 1 on ranks 0 and 2, 2 twice on
  // rank 1 (as EPLB may pack it) and once on rank 0, the rest once.
  const std::vector<int32_t> slot_rank = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2};
  const std::vector<int32_t> slot_expert = {0, 1, 2, 3, 0, 2, 2, 4, 0, 1, 5};
  std::vector<std::vector<int32_t>> copies(6);
  for (size_t s = 0; s < slot_expert.size(); ++s) copies[slot_expert[s]].push_back(int32_t(s));
  std::mt19937 random(7);
  for (int trial = 0; trial < 200; ++trial) {
    // The step's tokens per expert, then the same tokens sent three ways: all by rank 0, all by
    // rank 2, and each by a random rank.
    std::vector<int32_t> tokens;
    for (int32_t e = 0; e < 6; ++e)
      for (int k = int(random() % 9); k > 0; --k) tokens.push_back(e);
    std::shuffle(tokens.begin(), tokens.end(), random);
    std::vector<std::vector<std::vector<int32_t>>> ways(3, std::vector<std::vector<int32_t>>(3));
    for (int32_t e : tokens) {
      ways[0][0].push_back(e);
      ways[1][2].push_back(e);
      ways[2][random() % 3].push_back(e);
    }
    std::vector<std::vector<int64_t>> per_slot;
    for (const auto& sent : ways) {
      std::vector<int64_t> dispatched(copies.size(), 0);
      const auto slots = ep::slots_for_entries(sent, copies, dispatched);
      ASSERT_EQ(slots.size(), sent.size());
      auto& count = per_slot.emplace_back(slot_rank.size(), 0);
      for (size_t q = 0; q < sent.size(); ++q) {
        ASSERT_EQ(slots[q].size(), sent[q].size());
        for (size_t i = 0; i < sent[q].size(); ++i) {
          ASSERT_EQ(slot_expert[size_t(slots[q][i])], sent[q][i]) << "a copy of another expert";
          ++count[size_t(slots[q][i])];
        }
      }
      for (int32_t e = 0; e < 6; ++e) {
        const auto t = std::count(tokens.begin(), tokens.end(), e);
        const auto c = int64_t(copies[size_t(e)].size());
        for (int32_t s : copies[size_t(e)])
          EXPECT_TRUE(count[size_t(s)] == t / c || count[size_t(s)] == (t + c - 1) / c)
              << "trial " << trial << ": expert " << e << " with " << t << " tokens over " << c
              << " copies gave slot " << s << " " << count[size_t(s)];
      }
    }
    EXPECT_EQ(per_slot[0], per_slot[1]) << "trial " << trial;
    EXPECT_EQ(per_slot[0], per_slot[2]) << "trial " << trial;
  }
}

// Over steps too: single-sequence decode sends one token of an expert per step, and a step's
// remainder tokens must not always fall on the same copies, or one copy runs the expert's whole
// load while the planner counted a third of it on each of three.
TEST(ExpertDispatch, EveryCopyOfAnExpertGetsAnEvenShareOfItsTokensOverSteps) {
  const std::vector<std::vector<int32_t>> copies = {{0, 2, 4}, {1}, {3, 5}};
  for (int tokens_per_step = 1; tokens_per_step <= 5; ++tokens_per_step) {
    std::vector<int64_t> dispatched(copies.size(), 0), count(6, 0);
    for (int step = 0; step < 100; ++step) {
      // Rank 1 sends this step's tokens of expert 0 and one of expert 2; ranks 0 and 2 nothing.
      std::vector<std::vector<int32_t>> sent(3);
      sent[1].assign(size_t(tokens_per_step), 0);
      sent[1].push_back(2);
      const auto slots = ep::slots_for_entries(sent, copies, dispatched);
      for (const auto& rank : slots)
        for (int32_t s : rank) ++count[size_t(s)];
    }
    const auto [least, most] = std::minmax({count[0], count[2], count[4]});
    EXPECT_LE(most - least, 1) << tokens_per_step << " tokens a step over 3 copies: " << count[0]
                               << " " << count[2] << " " << count[4];
    EXPECT_LE(std::abs(count[3] - count[5]), 1)
        << "one token a step over 2 copies: " << count[3] << " " << count[5];
    EXPECT_EQ(count[0] + count[2] + count[4], 100 * tokens_per_step);
  }
}

struct Answer {
  std::string text;
  std::vector<double> logprobs;  // of the chosen tokens
  std::vector<std::map<std::string, double>> top;
};

class ExpertParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new std::filesystem::path(test::temp_path("expert-parallel").replace_extension());
    for (const auto& [name, preset, dtype] :
         {std::tuple{"v3-bf16", "tiny-v3", "bf16"}, std::tuple{"v3-f32", "tiny-v3", "f32"},
          std::tuple{"v2-lite-bf16", "tiny-v2-lite", "bf16"}}) {
      const auto dir = *root_ / name;
      ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) + " make-model --preset " + preset +
                                  " --dtype " + dtype + " --out " + test::quote(dir) +
                                  " >/dev/null 2>&1"),
                0);
    }
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*root_);
    delete root_;
  }

  static std::vector<std::string> args(const std::string& model, int ranks,
                                       std::vector<std::string> extra = {}) {
    std::vector<std::string> a = {TANDEM_BINARY,
                                  "engine",
                                  "--model",
                                  (*root_ / model).string(),
                                  "--served-model-name",
                                  "tiny",
                                  "--host",
                                  "127.0.0.1",
                                  "--port",
                                  "0",
                                  "--expert-parallel",
                                  std::to_string(ranks)};
    if (std::find(extra.begin(), extra.end(), "--num-kv-blocks") == extra.end())
      a.insert(a.end(), {"--num-kv-blocks", "512"});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  // Eight requests at once (prompts of 1 to 70 tokens): steps mix prefill chunks and decodes.
  static std::vector<Answer> ask_all(uint16_t port, int top_logprobs = 0) {
    std::vector<std::future<Answer>> futures;
    for (int i = 0; i < 8; ++i)
      futures.push_back(std::async(std::launch::async, [=] {
        json body = {{"prompt", prompt(1 + i * 10, 300 + 41 * i)},
                     {"max_tokens", 10 + i},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"logprobs", top_logprobs}};
        auto r = testing::post_json(port, "/v1/completions", body);
        EXPECT_EQ(r.status, 200) << r.body;
        Answer a;
        if (r.status != 200) return a;
        const json c = json::parse(r.body)["choices"][0];
        a.text = c["text"];
        for (const auto& lp : c["logprobs"]["token_logprobs"]) a.logprobs.push_back(lp);
        for (const auto& top : c["logprobs"]["top_logprobs"])
          a.top.push_back(top.is_object() ? top.get<std::map<std::string, double>>()
                                          : std::map<std::string, double>{});
        return a;
      }));
    std::vector<Answer> out;
    for (auto& f : futures) out.push_back(f.get());
    return out;
  }

  static void expect_same_texts(const std::vector<Answer>& want, const std::vector<Answer>& got,
                                const std::string& what) {
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_EQ(got[i].text, want[i].text) << what << ", request " << i;
  }

  static std::string run_and_capture(const std::vector<std::string>& a, int* status) {
    std::string cmd;
    for (const auto& s : a) cmd += test::quote(s) + " ";
    const auto out = test::temp_path("ep-output");
    *status = test::run_command(cmd + "> " + test::quote(out) + " 2>&1");
    std::ifstream in(out);
    std::stringstream text;
    text << in.rdbuf();
    std::filesystem::remove(out);
    return text.str();
  }

  inline static std::filesystem::path* root_ = nullptr;
};

TEST_F(ExpertParallel, TwoAndFourRanksGiveTheSingleProcessTokensOnBothTinyModels) {
  for (const std::string model : {"v3-bf16", "v2-lite-bf16"}) {
    // A 16-token step budget: the longer prompts are prefilled in chunks beside decodes. Each
    // rank runs attention over its own sequences only, so its batches differ from the single
    // process's: batch-invariant numerics make BF16 tokens independent of that (without, a
    // near-tie may flip where the CPU's BF16 GEMM sums in another order than its row kernel).
    const std::vector<std::string> chunked = {"--max-num-batched-tokens", "16",
                                              "--batch-invariant"};
    std::vector<Answer> want;
    {
      testing::EngineProcess single(args(model, 1, chunked));
      want = ask_all(single.port());
    }
    for (int ranks : {2, 4}) {
      testing::EngineProcess ep(args(model, ranks, chunked));
      expect_same_texts(want, ask_all(ep.port()),
                        model + " with " + std::to_string(ranks) + " ranks");
      // Routes are counted on every rank and summed: 8 prompts and their outputs.
      const json load = testing::get_json(ep.port(), "/expert_load");
      int64_t routed = 0;
      for (const auto& row : load["cumulative"])
        for (const auto& v : row) routed += v.get<int64_t>();
      EXPECT_GT(routed, 0);
      EXPECT_EQ(routed % load["layers"].get<int64_t>(), 0);
      // Every route ran exactly once, on some rank: the ranks' expert rows add up to the routes.
      const json ranks_work = testing::get_json(ep.port(), "/admin/expert_placement")["ranks"];
      ASSERT_EQ(ranks_work.size(), size_t(ranks));
      int64_t rows = 0;
      for (const auto& w : ranks_work) rows += w["expert_rows"].get<int64_t>();
      EXPECT_EQ(rows, routed);
    }
  }
}

TEST_F(ExpertParallel, FloatLogprobsAgreeWithOneProcessWithinOneHundredThousandth) {
  std::vector<Answer> want;
  {
    testing::EngineProcess single(args("v3-f32", 1));
    want = ask_all(single.port(), 3);
  }
  for (int ranks : {2, 4}) {
    testing::EngineProcess ep(args("v3-f32", ranks));
    const auto got = ask_all(ep.port(), 3);
    expect_same_texts(want, got, "f32");
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
      for (size_t k = 0; k < want[i].logprobs.size(); ++k) {
        EXPECT_NEAR(got[i].logprobs[k], want[i].logprobs[k], 1e-5) << "request " << i;
        for (const auto& [token, lp] : want[i].top[k])
          if (got[i].top[k].count(token)) {
            EXPECT_NEAR(got[i].top[k].at(token), lp, 1e-5);
          }
      }
    }
  }
}

TEST_F(ExpertParallel, RedundantCopiesAndPreemptionKeepTheAnswers) {
  // Layer 0: every expert on both ranks (tokens stay on their own rank); layer 1: experts 0-2
  // on both ranks, so tokens of one expert split between two copies.
  const json placement = placement_json(2, 8,
                                        {{{0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}},
                                         {{0, 1, 2, 3, 4}, {5, 6, 7, 0, 1, 2}}});
  const auto file = test::temp_path("ep-placement");
  std::ofstream(file) << placement.dump();
  // 24 blocks of 8 tokens for eight requests of up to 88 tokens: they wait, get preempted and
  // are recomputed. Batch-invariant numerics, as above: which requests share a step depends on
  // timing here, and in BF16 a near-tie could otherwise flip with it.
  const std::vector<std::string> tight = {
      "--block-size",     "8", "--num-kv-blocks", "24", "--max-num-batched-tokens", "32",
      "--batch-invariant"};
  std::vector<Answer> want;
  {
    testing::EngineProcess single(args("v3-bf16", 1, tight));
    want = ask_all(single.port());
  }
  auto with_placement = tight;
  with_placement.insert(with_placement.end(), {"--expert-placement", file.string()});
  testing::EngineProcess ep(args("v3-bf16", 2, with_placement));
  expect_same_texts(want, ask_all(ep.port()), "redundant copies");
  EXPECT_GT(testing::metric(ep.port(), "vllm:num_preemptions_total"), 0);
  std::filesystem::remove(file);
}

// `tandem place plan --algorithm eplb` packs copies onto ranks by load alone, so for one hot
// expert per layer it puts two copies of it on one rank. The engine serves such a plan as the
// placement with the second copy left out (one set of weights, the rows of both run together):
// the answers and logprobs must be those of that single-copy placement, bit for bit
// (batch-invariant numerics: which requests share a step depends on timing).
TEST_F(ExpertParallel, AnEplbPlanWithTwoCopiesOnOneRankServesAsItsSingleCopies) {
  const auto loads = test::temp_path("ep-loads").replace_extension(".json");
  std::ofstream(loads) << "[[100,1,1,1,1,1,1,1],[1,1,1,1,1,1,1,100]]";
  const auto eplb = test::temp_path("ep-eplb").replace_extension(".json");
  int status = 0;
  const std::string planned =
      run_and_capture({TANDEM_BINARY, "place", "plan", "--loads", loads.string(), "--ranks", "2",
                       "--slots", "10", "--algorithm", "eplb", "--out", eplb.string()},
                      &status);
  ASSERT_EQ(status, 0) << planned;
  const json doubled = json::parse(std::ifstream(eplb));
  // The same placement with every copy of an expert after its first on a rank left out.
  std::vector<std::vector<std::vector<int>>> single_layers;
  bool has_double = false;
  for (size_t l = 0; l < doubled["phy2log"].size(); ++l) {
    auto& layer = single_layers.emplace_back();
    size_t slot = 0;
    for (const auto& count : doubled["rank_slots"][l]) {
      auto& rank = layer.emplace_back();
      for (int k = 0; k < count.get<int>(); ++k, ++slot) {
        const int e = doubled["phy2log"][l][slot];
        if (std::find(rank.begin(), rank.end(), e) == rank.end())
          rank.push_back(e);
        else
          has_double = true;
      }
    }
  }
  ASSERT_TRUE(has_double) << doubled.dump();
  const auto single_file = test::temp_path("ep-single").replace_extension(".json");
  std::ofstream(single_file) << placement_json(2, 8, single_layers).dump();

  const std::vector<std::string> invariant = {"--batch-invariant"};
  const auto with = [&](const std::filesystem::path& file) {
    auto a = invariant;
    a.insert(a.end(), {"--expert-placement", file.string()});
    return args("v3-bf16", 2, a);
  };
  std::vector<Answer> want;
  {
    testing::EngineProcess single(with(single_file));
    want = ask_all(single.port(), 1);
  }
  const auto expect_same = [&](const std::vector<Answer>& got, const std::string& what) {
    expect_same_texts(want, got, what);
    for (size_t i = 0; i < want.size() && i < got.size(); ++i)
      EXPECT_EQ(got[i].logprobs, want[i].logprobs) << what << ", request " << i;
  };
  testing::EngineProcess ep(with(eplb));
  expect_same(ask_all(ep.port(), 1), "two copies on one rank");
  const json shown = testing::get_json(ep.port(), "/admin/expert_placement");
  EXPECT_EQ(shown["placement"]["phy2log"], doubled["phy2log"]);
  // Every route ran exactly once, though a rank lists some experts twice.
  const json load = testing::get_json(ep.port(), "/expert_load");
  int64_t routed = 0, rows = 0;
  for (const auto& row : load["cumulative"])
    for (const auto& v : row) routed += v.get<int64_t>();
  for (const auto& w : shown["ranks"]) rows += w["expert_rows"].get<int64_t>();
  EXPECT_EQ(rows, routed);
  // Live: the ranks' halves swapped and a third copy on one rank (the copies loaded beside the
  // running ones, each expert once).
  json swapped = doubled;
  for (size_t l = 0; l < swapped["phy2log"].size(); ++l) {
    const json counts = swapped["rank_slots"][l];
    const std::vector<int> row = swapped["phy2log"][l];
    const std::vector<int> first(row.begin(), row.begin() + counts[0].get<int>()),
        second(row.begin() + counts[0].get<int>(), row.end());
    std::vector<int> next = second;
    next.insert(next.end(), first.begin(), first.end());
    next.push_back(next.front());
    swapped["phy2log"][l] = next;
    swapped["rank_slots"][l] = {counts[1].get<int>() + 1, counts[0]};
  }
  swapped.erase("log2phy");
  swapped.erase("logcnt");
  const auto r = testing::post_json(ep.port(), "/admin/expert_placement", swapped);
  ASSERT_EQ(r.status, 202) << r.body;
  ASSERT_TRUE(testing::eventually(
      [&] { return testing::get_json(ep.port(), "/admin/expert_placement")["remaps"] == 1; }));
  expect_same(ask_all(ep.port(), 1), "after a live switch to three copies on one rank");
  for (const auto& f : {loads, eplb, single_file}) std::filesystem::remove(f);
}

TEST_F(ExpertParallel, APlacementThatDoesNotFitIsRefusedNamingWhatIsWrong) {
  const auto file = test::temp_path("ep-bad-placement");
  const std::vector<std::pair<json, std::string>> cases = {
      // Expert 7 has no copy in layer 1.
      {placement_json(2, 8, {{{0, 1, 2, 3}, {4, 5, 6, 7}}, {{0, 1, 2, 3}, {4, 5, 6, 5}}}),
       "expert 7"},
      // One layer for a model with two MoE layers.
      {placement_json(2, 8, {{{0, 1, 2, 3}, {4, 5, 6, 7}}}), "layers"},
      // Four ranks for an engine of two.
      {placement_json(4, 8, {{{0, 1}, {2, 3}, {4, 5}, {6, 7}}, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}}),
       "ranks"}};
  for (const auto& [placement, field] : cases) {
    std::ofstream(file) << placement.dump();
    int status = 0;
    const std::string out =
        run_and_capture(args("v3-bf16", 2, {"--expert-placement", file.string()}), &status);
    EXPECT_NE(status, 0) << out;
    EXPECT_NE(out.find(field), std::string::npos) << out;
    // Named as the flag and the file, whether reading it or fitting it to the model failed.
    EXPECT_NE(out.find("--expert-placement " + file.string() + ": "), std::string::npos) << out;
  }
  std::filesystem::remove(file);
}

TEST_F(ExpertParallel, LiveRemapsUnderTrafficLoseNothingAndChangeNoAnswer) {
  std::vector<Answer> want;
  {
    testing::EngineProcess single(args("v3-bf16", 1));
    want = ask_all(single.port());
  }
  testing::EngineProcess ep(args("v3-bf16", 2));
  const json start = testing::get_json(ep.port(), "/admin/expert_placement");
  EXPECT_EQ(start["state"], "idle");
  EXPECT_EQ(start["placement"]["rank_slots"], json::parse("[[4,4],[4,4]]"));
  const std::vector<json> placements = {
      // Every expert of layer 0 on both ranks; layer 1 with two experts copied.
      placement_json(2, 8,
                     {{{0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}},
                      {{4, 5, 6, 7, 0}, {0, 1, 2, 3, 5}}}),
      // The ranks' halves swapped.
      placement_json(2, 8, {{{4, 5, 6, 7}, {0, 1, 2, 3}}, {{4, 5, 6, 7}, {0, 1, 2, 3}}}),
      // Uneven: six experts on rank 0, two on rank 1.
      placement_json(2, 8, {{{0, 1, 2, 3, 4, 5}, {6, 7}}, {{0, 1}, {2, 3, 4, 5, 6, 7}}})};
  // Traffic all along: three rounds of eight concurrent requests.
  auto traffic = std::async(std::launch::async, [&] {
    std::vector<std::vector<Answer>> rounds;
    for (int r = 0; r < 3; ++r) rounds.push_back(ask_all(ep.port()));
    return rounds;
  });
  for (size_t i = 0; i < placements.size(); ++i) {
    const auto r = testing::post_json(ep.port(), "/admin/expert_placement", placements[i]);
    ASSERT_EQ(r.status, 202) << r.body;
    ASSERT_TRUE(testing::eventually([&] {
      return testing::get_json(ep.port(), "/admin/expert_placement")["remaps"] == int(i + 1);
    })) << "placement "
        << i << " never switched in";
  }
  for (const auto& round : traffic.get()) expect_same_texts(want, round, "during remaps");
  const json done = testing::get_json(ep.port(), "/admin/expert_placement");
  EXPECT_EQ(done["state"], "idle");
  EXPECT_EQ(done["placement"]["phy2log"], placements.back()["phy2log"]);
  EXPECT_GT(done["last"]["moves"].get<int>(), 0);
  EXPECT_GE(done["last"]["pause_seconds"].get<double>(), 0.0);
  EXPECT_EQ(testing::metric(ep.port(), "tandem:expert_remaps_total"), 3);
  // Both ranks computed routed rows and went through the same MoE layers (collectives).
  ASSERT_EQ(done["ranks"].size(), 2u);
  EXPECT_GT(done["ranks"][0]["expert_rows"].get<int64_t>(), 0);
  EXPECT_GT(done["ranks"][1]["expert_rows"].get<int64_t>(), 0);
  EXPECT_EQ(done["ranks"][0]["moe_layers"], done["ranks"][1]["moe_layers"]);
  // And after the last switch, the answers still match.
  expect_same_texts(want, ask_all(ep.port()), "after remaps");
}

TEST_F(ExpertParallel, BadPlacementsGet400NamingTheFieldAndTheOldOneStays) {
  testing::EngineProcess ep(args("v3-bf16", 2));
  const json before = testing::get_json(ep.port(), "/admin/expert_placement")["placement"];
  const std::vector<std::pair<std::string, std::string>> cases = {
      {placement_json(2, 8, {{{0, 1, 2, 3}, {4, 5, 6, 7}}, {{0, 1, 2, 3}, {4, 5, 6, 5}}}).dump(),
       "expert 7"},
      {placement_json(2, 8, {{{0, 1, 2, 3}, {4, 5, 6, 7}}}).dump(), "layers"},
      {placement_json(3, 8, {{{0, 1, 2}, {3, 4, 5}, {6, 7}}, {{0, 1, 2}, {3, 4, 5}, {6, 7}}})
           .dump(),
       "ranks"},
      // Slot counts per rank that do not add up to the layer's slots.
      {R"({"ranks":2,"experts":8,"phy2log":[[0,1,2,3,4,5,6,7],[0,1,2,3,4,5,6,7]],)"
       R"("rank_slots":[[4,3],[4,4]]})",
       "slots"},
      {"{not json", "JSON"}};
  for (const auto& [body, field] : cases) {
    const auto r =
        net::http_request("127.0.0.1", ep.port(), "POST", "/admin/expert_placement", body);
    EXPECT_EQ(r.status, 400) << body;
    EXPECT_NE(r.body.find(field), std::string::npos) << r.body;
    EXPECT_NE(r.body.find("\"error\""), std::string::npos) << r.body;
  }
  const json after = testing::get_json(ep.port(), "/admin/expert_placement");
  EXPECT_EQ(after["placement"], before);
  EXPECT_EQ(after["remaps"], 0);
  EXPECT_EQ(after["state"], "idle");
  // An engine of one process places no experts: a change is 404 as the placement it would change
  // (before the body is read).
  testing::EngineProcess single(args("v3-bf16", 1));
  EXPECT_EQ(net::http_request("127.0.0.1", single.port(), "GET", "/admin/expert_placement").status,
            404);
  EXPECT_EQ(net::http_request("127.0.0.1", single.port(), "POST", "/admin/expert_placement",
                              placement_json(2, 8, {{{0, 1, 2, 3}, {4, 5, 6, 7}}}).dump())
                .status,
            404);
}

TEST_F(ExpertParallel, RebalancesItselfFromItsOwnExpertLoad) {
  std::vector<Answer> want;
  {
    testing::EngineProcess single(args("v3-bf16", 1));
    want = ask_all(single.port());
  }
  testing::EngineProcess ep(args("v3-bf16", 2, {"--rebalance-interval", "4"}));
  for (int r = 0; r < 2; ++r) expect_same_texts(want, ask_all(ep.port()), "rebalancing");
  ASSERT_TRUE(testing::eventually(
      [&] { return testing::get_json(ep.port(), "/admin/expert_placement")["state"] == "idle"; }));
  const json status = testing::get_json(ep.port(), "/admin/expert_placement");
  EXPECT_GE(status["automatic_remaps"].get<int>(), 1) << status.dump();
  EXPECT_EQ(status["remaps"], status["automatic_remaps"]);
}

TEST_F(ExpertParallel, RebalancingAPlacementWithDrainedRanksKeepsServing) {
  testing::EngineProcess ep(args("v3-bf16", 4, {"--rebalance-interval", "1"}));
  // Ranks 2 and 3 drained: every expert on both of ranks 0 and 1. The planner once could not
  // plan such slots and its throw ended the engine at the next step.
  const std::vector<int> all = {0, 1, 2, 3, 4, 5, 6, 7};
  const json drained = placement_json(4, 8, {{all, all, {}, {}}, {all, all, {}, {}}});
  const auto r = testing::post_json(ep.port(), "/admin/expert_placement", drained);
  ASSERT_EQ(r.status, 202) << r.body;
  ASSERT_TRUE(testing::eventually(
      [&] { return testing::get_json(ep.port(), "/admin/expert_placement")["remaps"] == 1; }));
  for (const Answer& a : ask_all(ep.port())) EXPECT_FALSE(a.text.empty());
  EXPECT_EQ(net::http_request("127.0.0.1", ep.port(), "GET", "/health").status, 200);
  const json status = testing::get_json(ep.port(), "/admin/expert_placement");
  EXPECT_FALSE(status.contains("last_error")) << status.dump();
  EXPECT_EQ(status["placement"]["rank_slots"], drained["rank_slots"]);
}

TEST_F(ExpertParallel, AKilledRankFailsTheRequestsInFlightAndTheEngineReportsUnhealthy) {
  testing::EngineProcess ep(args("v3-bf16", 2));
  const auto ranks = children_of(ep.pid());
  ASSERT_EQ(ranks.size(), 1u);
  EXPECT_EQ(net::http_request("127.0.0.1", ep.port(), "GET", "/health").status, 200);
  // A long stream, cut by the rank's death: it must end with an error event and [DONE].
  auto stream = std::async(std::launch::async, [&] {
    return testing::post_json(ep.port(), "/v1/completions",
                              {{"prompt", "Once upon a time"},
                               {"max_tokens", 4000},
                               {"ignore_eos", true},
                               {"stream", true}});
  });
  ASSERT_TRUE(testing::eventually(
      [&] { return testing::get_json(ep.port(), "/load")["running"].get<int>() == 1; }));
  kill(ranks[0], SIGKILL);
  const auto sse = stream.get();
  EXPECT_EQ(sse.status, 200);
  EXPECT_NE(sse.body.find("\"error\""), std::string::npos) << sse.body.substr(0, 300);
  EXPECT_NE(sse.body.find("expert-parallel rank 1"), std::string::npos);
  EXPECT_NE(sse.body.find("data: [DONE]"), std::string::npos);
  const auto health = net::http_request("127.0.0.1", ep.port(), "GET", "/health");
  EXPECT_EQ(health.status, 503);
  EXPECT_NE(health.body.find("rank 1"), std::string::npos) << health.body;
  // Later requests fail at once with an OpenAI error instead of hanging.
  const auto later =
      testing::post_json(ep.port(), "/v1/completions", {{"prompt", "hello"}, {"max_tokens", 4}});
  EXPECT_GE(later.status, 500);
  EXPECT_NE(later.body.find("\"error\""), std::string::npos) << later.body;
  EXPECT_EQ(ep.stop(), 0);
  EXPECT_FALSE(running(ranks[0]));
}

TEST_F(ExpertParallel, ARankThatDiesWhileIdleMakesTheEngineUnhealthy) {
  testing::EngineProcess ep(args("v3-bf16", 2));
  const auto ranks = children_of(ep.pid());
  ASSERT_EQ(ranks.size(), 1u);
  kill(ranks[0], SIGKILL);
  EXPECT_TRUE(testing::eventually(
      [&] { return net::http_request("127.0.0.1", ep.port(), "GET", "/health").status == 503; }));
  const auto r =
      testing::post_json(ep.port(), "/v1/completions", {{"prompt", "hello"}, {"max_tokens", 4}});
  EXPECT_GE(r.status, 500);
  EXPECT_NE(r.body.find("rank 1"), std::string::npos) << r.body;
  // No placement change can happen: the remap state says failed and why, and a change is the
  // engine's 503, not a 400 about a placement that is fine.
  const json remap = testing::get_json(ep.port(), "/admin/expert_placement");
  EXPECT_EQ(remap["state"], "failed") << remap.dump();
  EXPECT_NE(remap.value("last_error", "").find("rank 1"), std::string::npos) << remap.dump();
  const auto change = testing::post_json(
      ep.port(), "/admin/expert_placement",
      placement_json(2, 8, {{{4, 5, 6, 7}, {0, 1, 2, 3}}, {{4, 5, 6, 7}, {0, 1, 2, 3}}}));
  EXPECT_EQ(change.status, 503) << change.body;
  EXPECT_NE(change.body.find("server_error"), std::string::npos) << change.body;
  EXPECT_NE(change.body.find("rank 1"), std::string::npos) << change.body;
  EXPECT_EQ(ep.stop(), 0);
}

TEST_F(ExpertParallel, ARankThatStopsMidStepFailsTheStepNamingItAndTheEngineReportsUnhealthy) {
  testing::EngineProcess ep(args("v3-bf16", 2, {"--expert-parallel-stall-timeout", "1"}));
  const auto ranks = children_of(ep.pid());
  ASSERT_EQ(ranks.size(), 1u);
  // Alive but making no progress: its process does not exit, so only the front's wait can tell.
  kill(ranks[0], SIGSTOP);
  const auto r =
      testing::post_json(ep.port(), "/v1/completions", {{"prompt", "hello"}, {"max_tokens", 4}});
  EXPECT_GE(r.status, 500);
  EXPECT_NE(r.body.find("expert-parallel rank 1 stalled"), std::string::npos) << r.body;
  const auto health = net::http_request("127.0.0.1", ep.port(), "GET", "/health");
  EXPECT_EQ(health.status, 503);
  EXPECT_NE(health.body.find("rank 1 stalled"), std::string::npos) << health.body;
  EXPECT_EQ(ep.stop(), 0);
  EXPECT_TRUE(testing::eventually([&] { return !running(ranks[0]); }));  // killed, not left stopped
}

TEST_F(ExpertParallel, NoRankOutlivesItsEngineHoweverItStops) {
  {
    testing::EngineProcess ep(args("v3-bf16", 4));
    const auto ranks = children_of(ep.pid());
    ASSERT_EQ(ranks.size(), 3u);
    EXPECT_EQ(ep.stop(), 0);  // SIGTERM: an orderly shutdown
    for (pid_t r : ranks) EXPECT_FALSE(running(r));
  }
  {
    testing::EngineProcess ep(args("v3-bf16", 4));
    const auto ranks = children_of(ep.pid());
    ASSERT_EQ(ranks.size(), 3u);
    ep.kill_now();  // SIGKILL of the front: its ranks die with it (and with them the segment)
    for (pid_t r : ranks) EXPECT_TRUE(testing::eventually([&] { return !running(r); }));
  }
}

// An upgrade replaces the binary under a running engine (cp new, then mv over the old path):
// its ranks, started from that engine, still run its own program, though the path it was started
// by now names another file.
TEST_F(ExpertParallel, AnEngineWhoseBinaryWasReplacedOnDiskStillStartsItsRanks) {
  const auto dir = test::temp_path("ep-upgrade").replace_extension();
  std::filesystem::create_directories(dir);
  const auto installed = dir / "tandem";
  std::filesystem::copy_file(TANDEM_BINARY, installed);
  // The engine runs the old file through this descriptor, replaced before the engine starts:
  // whatever the engine does before it starts its ranks, they start after the replacement.
  const int old_binary = ::open(installed.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(old_binary, 0);
  std::filesystem::copy_file(TANDEM_BINARY, dir / "tandem.new");
  std::filesystem::rename(dir / "tandem.new", installed);
  auto a = args("v3-bf16", 2);
  a[0] = "/proc/self/fd/" + std::to_string(old_binary);
  std::optional<testing::EngineProcess> ep;
  EXPECT_NO_THROW(ep.emplace(a));
  ::close(old_binary);
  if (ep) {
    const auto ranks = children_of(ep->pid());
    ASSERT_EQ(ranks.size(), 1u);
    // Run as /proc/self/exe, which the kernel would name "exe": `pgrep tandem` finds it.
    std::ifstream comm("/proc/" + std::to_string(ranks[0]) + "/comm");
    std::string name;
    std::getline(comm, name);
    EXPECT_EQ(name, "tandem");
    for (const Answer& answer : ask_all(ep->port())) EXPECT_FALSE(answer.text.empty());
    EXPECT_EQ(ep->stop(), 0);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tandem::engine
