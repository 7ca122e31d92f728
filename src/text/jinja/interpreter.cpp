#include "text/jinja/interpreter.h"

#include <memory>
#include <new>
#include <stdexcept>

#include "text/jinja/builtins.h"
#include "text/jinja/lexer.h"
#include "util/error.h"

namespace tandem::text::jinja {
namespace {

// Variable scope. Jinja2 gives each for-loop iteration and each macro call a fresh scope whose
// assignments vanish when it ends; `if` blocks share their enclosing scope. Lookups see outer
// scopes at the time of the lookup (so a macro sees the caller's latest top-level values).
struct Frame {
  std::vector<std::pair<std::string, Value>> vars;
  std::shared_ptr<Frame> parent;

  const Value* find(const std::string& name) const {
    for (const Frame* f = this; f; f = f->parent.get()) {
      for (const auto& [k, v] : f->vars) {
        if (k == name) return &v;
      }
    }
    return nullptr;
  }
  void set(const std::string& name, Value value) {
    for (auto& [k, v] : vars) {
      if (k == name) {
        v = std::move(value);
        return;
      }
    }
    vars.emplace_back(name, std::move(value));
  }
};
using FramePtr = std::shared_ptr<Frame>;

FramePtr child_of(const FramePtr& parent) {
  auto f = std::make_shared<Frame>();
  f->parent = parent;
  return f;
}

enum class Flow { kNormal, kBreak, kContinue };

// Python allows about 1000 nested calls; stop runaway macro recursion well before the C++ stack.
constexpr int kMaxMacroDepth = 200;

// The rendered text, and any captured block. The render as a whole is bounded by its budget
// (value.h): steps and bytes built.
constexpr size_t kMaxOutputBytes = kMaxStringBytes;

class Renderer {
 public:
  std::string render(const Body& body, const nlohmann::ordered_json& context, RenderStats* stats) {
    auto root = std::make_shared<Frame>();
    if (!context.is_object()) throw Error("chat template context must be a JSON object");
    try {
      for (const auto& [k, v] : context.items()) root->set(k, Value::from_json(v));
    } catch (const UnsupportedError& e) {
      throw Error("chat template context: " + e.message);
    }
    // The request itself is not charged: its size has its own limits. It sets the step budget.
    RenderBudget budget(render_step_budget(json_size(context)));
    std::string out;
    exec_body(body, root, out);
    if (stats) *stats = budget.stats();
    return out;
  }

 private:
  Flow exec_body(const Body& body, const FramePtr& frame, std::string& out) {
    for (const auto& stmt : body) {
      Flow flow = exec(*stmt, frame, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  // Runs `f`; a template error it raises becomes an Error naming the template line.
  template <class F>
  static auto at_line(int line, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const RuntimeError& e) {
      throw Error(line_message(line, e.message));
    } catch (const UnsupportedError& e) {
      throw Error(line_message(line, e.message));
    } catch (const RaisedError& e) {
      throw Error(line_message(line, e.message));
    }
  }

  Flow exec(const Stmt& s, const FramePtr& frame, std::string& out) {
    return at_line(s.line, [&] {
      step();
      return exec_inner(s, frame, out);
    });
  }

  static void step() { charge_steps(1); }

  // Checked before appending, so an oversized output is never allocated.
  static void emit(std::string& out, std::string_view text) {
    if (text.size() > kMaxOutputBytes - out.size())
      throw RuntimeError{"the template's output exceeded " + std::to_string(kMaxOutputBytes >> 20) +
                         " MiB"};
    charge_bytes(static_cast<int64_t>(text.size()));
    out += text;
  }

  // {{ v }}: a string is written from its buffer, not copied first.
  static void emit_value(std::string& out, const Value& v) {
    if (v.is_string()) {
      emit(out, v.s);
    } else {
      emit(out, py_str(v));
    }
  }

  Flow exec_inner(const Stmt& s, const FramePtr& frame, std::string& out) {
    switch (s.kind) {
      case StmtKind::kData:
        emit(out, s.text);
        return Flow::kNormal;
      case StmtKind::kOutput:
        emit_value(out, eval(*s.expr, frame));
        return Flow::kNormal;
      case StmtKind::kIf:
        return exec_body(truthy(eval(*s.expr, frame)) ? s.body : s.else_body, frame, out);
      case StmtKind::kFor:
        return exec_for(s, frame, out);
      case StmtKind::kSet:
        assign(*s.target, eval(*s.expr, frame), frame);
        return Flow::kNormal;
      case StmtKind::kSetBlock: {
        std::string captured;
        exec_body(s.body, child_of(frame), captured);
        assign(*s.target, apply_filters(s.filters, Value::string(std::move(captured)), frame),
               frame);
        return Flow::kNormal;
      }
      case StmtKind::kFilterBlock: {
        std::string captured;
        exec_body(s.body, child_of(frame), captured);
        emit_value(out, apply_filters(s.filters, Value::string(std::move(captured)), frame));
        return Flow::kNormal;
      }
      case StmtKind::kMacro:
        frame->set(s.name, make_macro(s, frame));
        return Flow::kNormal;
      case StmtKind::kBreak:
        return Flow::kBreak;
      case StmtKind::kContinue:
        return Flow::kContinue;
      case StmtKind::kScope:
        return exec_body(s.body, child_of(frame), out);
    }
    return Flow::kNormal;
  }

  Value apply_filters(const std::vector<std::unique_ptr<Expr>>& filters, Value v,
                      const FramePtr& frame) {
    for (const auto& f : filters) {
      CallArgs args = eval_args(*f, 1, frame);
      v = apply_filter(f->name, v, args);
    }
    return v;
  }

  // A for loop's iterable. `for x in xs[a:b]` (gpt-oss's template looks ahead so from every
  // message) walks xs's own items: building the slice would copy them, n^2 / 2 copies for n
  // messages. For a step-1 slice of a list, tuple or range, returns xs with the slice's first
  // index and length in `begin` and `count`; otherwise the value, `count` left alone.
  Value eval_iterable(const Expr& e, const FramePtr& frame, size_t& begin, size_t& count) {
    if (e.kind != ExprKind::kGetItem || e.children[1]->kind != ExprKind::kSlice)
      return eval(e, frame);
    return at_line(e.line, [&]() -> Value {
      step();  // what eval charges for the subscript itself
      Value obj = eval(*e.children[0], frame);
      const Expr& key = *e.children[1];
      auto part = [&](size_t k) {
        return key.children[k] ? eval(*key.children[k], frame) : Value::none();
      };
      Value start = part(0), stop = part(1), stride = part(2);
      if (contiguous_slice(obj, start, stop, stride, begin, count)) return obj;
      return get_slice(obj, start, stop, stride);
    });
  }

  Flow exec_for(const Stmt& s, const FramePtr& frame, std::string& out) {
    constexpr size_t kWhole = static_cast<size_t>(-1);
    size_t begin = 0, count = kWhole;
    Value iterable = eval_iterable(*s.expr, frame, begin, count);
    if (count == kWhole && iterable.kind == Kind::kSequence &&
        iterable.seq->kind != SeqKind::kGenerator) {
      begin = 0;  // a list, tuple, range or dict view is looped over where it is, not copied
      count = iterable.seq->items.size();
    }
    auto info = std::make_shared<LoopInfo>();
    if (count != kWhole && !s.filter) {
      charge_steps(static_cast<int64_t>(count));  // walking the items, as py_iterate charges
      info->source = std::move(iterable);
      info->begin = begin;
      info->length = count;
    } else {
      std::vector<Value> items;
      if (count != kWhole) {
        charge_steps(static_cast<int64_t>(count));
        items.assign(iterable.seq->items.begin() + static_cast<std::ptrdiff_t>(begin),
                     iterable.seq->items.begin() + static_cast<std::ptrdiff_t>(begin + count));
      } else {
        items = py_iterate(iterable);
      }
      if (s.filter) {
        std::vector<Value> kept;
        for (auto& item : items) {
          auto f = child_of(frame);
          assign(*s.target, item, f);
          if (truthy(eval(*s.filter, f))) kept.push_back(std::move(item));
        }
        items = std::move(kept);
      }
      info->length = items.size();
      info->source.kind = Kind::kSequence;
      info->source.seq = std::make_shared<Sequence>();
      info->source.seq->items = std::move(items);
    }
    if (info->length == 0) return exec_body(s.else_body, frame, out);
    if (const Value* outer = frame->find("loop"); outer && outer->kind == Kind::kLoop) {
      info->depth = outer->loop->depth;  // non-recursive loops all have depth 1
    }
    Value loop;
    loop.kind = Kind::kLoop;
    loop.loop = info;
    for (size_t k = 0; k < info->length; ++k) {
      step();  // an iteration with an empty body still costs work
      info->index0 = k;
      auto f = child_of(frame);
      assign(*s.target, info->item(k), f);
      f->set("loop", loop);
      if (exec_body(s.body, f, out) == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  void assign(const Expr& target, const Value& value, const FramePtr& frame) {
    if (target.kind == ExprKind::kName) {
      frame->set(target.name, value);
      return;
    }
    if (target.kind == ExprKind::kTuple) {
      std::vector<Value> items = py_iterate(value);
      size_t n = target.children.size();
      if (items.size() < n) {
        throw RuntimeError{"not enough values to unpack (expected " + std::to_string(n) + ", got " +
                           std::to_string(items.size()) + ")"};
      }
      if (items.size() > n) {
        throw RuntimeError{"too many values to unpack (expected " + std::to_string(n) + ")"};
      }
      for (size_t k = 0; k < n; ++k) assign(*target.children[k], items[k], frame);
      return;
    }
    // kNsRef: `set ns.attr = value` mutates a namespace() object visible in outer scopes.
    const Value* ns = frame->find(target.name);
    if (!ns || ns->kind != Kind::kNamespace) {
      throw RuntimeError{"cannot assign attribute on non-namespace object"};
    }
    ns->ns->set(target.attr, value);
    if (assigned_.empty() || assigned_.back().lock() != ns->ns) assigned_.push_back(ns->ns);
  }

  Value make_macro(const Stmt& m, const FramePtr& defining) {
    Value v;
    v.kind = Kind::kCallable;
    v.fn = std::make_shared<Callable>();
    v.fn->name = m.name;
    // The defining scope is held weakly: a macro stored in that scope must not keep it alive.
    std::weak_ptr<Frame> weak = defining;
    v.fn->fn = [this, &m, weak](CallArgs& a) { return call_macro(m, weak.lock(), a); };
    return v;
  }

  // jinja2.runtime.Macro.__call__: positional arguments first; keyword arguments fill only the
  // parameters left over (with every parameter given by position, a keyword naming one is
  // extra); extra ones go to `kwargs` / `varargs` when the body reads those, else are an error.
  Value call_macro(const Stmt& m, const FramePtr& defining, CallArgs& a) {
    auto f = child_of(defining);
    const size_t n = m.params.size();
    std::vector<bool> used(a.kwargs.size(), false);
    for (size_t k = 0; k < n; ++k) {
      const std::string& p = m.params[k];
      std::optional<Value> value;
      if (k < a.args.size()) {
        value = a.args[k];
      } else {
        for (size_t j = 0; j < a.kwargs.size(); ++j) {
          if (used[j] || a.kwargs[j].first != p) continue;
          value = a.kwargs[j].second;
          used[j] = true;
          break;
        }
      }
      if (!value) {
        value = m.defaults[k] ? eval(*m.defaults[k], f)
                              : Value::undefined("parameter '" + p + "' was not provided");
      }
      f->set(p, *value);
    }
    if (m.catch_kwargs) {
      Value kwargs;
      kwargs.kind = Kind::kDict;
      kwargs.dict = std::make_shared<Dict>();
      for (size_t j = 0; j < a.kwargs.size(); ++j)
        if (!used[j]) kwargs.dict->set(Value::string(a.kwargs[j].first), a.kwargs[j].second);
      f->set("kwargs", kwargs);
    } else {
      for (size_t j = 0; j < a.kwargs.size(); ++j) {
        if (!used[j]) {
          throw RuntimeError{"macro '" + m.name + "' takes no keyword argument '" +
                             a.kwargs[j].first + "'"};
        }
      }
    }
    if (m.catch_varargs) {
      std::vector<Value> extra;
      for (size_t k = n; k < a.args.size(); ++k) extra.push_back(a.args[k]);
      f->set("varargs", Value::tuple(std::move(extra)));
    } else if (a.args.size() > n) {
      throw RuntimeError{"macro '" + m.name + "' takes not more than " + std::to_string(n) +
                         " argument(s)"};
    }
    if (++depth_ > kMaxMacroDepth) {
      --depth_;
      throw RuntimeError{"maximum macro recursion depth exceeded"};
    }
    std::string out;
    try {
      exec_body(m.body, f, out);
    } catch (...) {
      --depth_;
      throw;
    }
    --depth_;
    return Value::string(std::move(out));
  }

  CallArgs eval_args(const Expr& e, size_t first, const FramePtr& frame) {
    CallArgs a;
    for (size_t k = first; k < e.children.size(); ++k)
      a.args.push_back(eval(*e.children[k], frame));
    for (const auto& [name, expr] : e.kwargs) a.kwargs.emplace_back(name, eval(*expr, frame));
    return a;
  }

  Value eval(const Expr& e, const FramePtr& frame) {
    return at_line(e.line, [&] {
      step();
      return eval_inner(e, frame);
    });
  }

  bool compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return py_equal(a, b);
    if (op == "!=") return !py_equal(a, b);
    if (op == "<") return py_less(a, b);
    if (op == ">") return py_less(b, a);
    if (op == "<=") return py_less(a, b) || py_equal(a, b);
    if (op == ">=") return py_less(b, a) || py_equal(a, b);
    if (op == "in") return contains(b, a);
    return !contains(b, a);  // notin
  }

  Value eval_inner(const Expr& e, const FramePtr& frame) {
    switch (e.kind) {
      case ExprKind::kConst:
        return e.value;
      case ExprKind::kName: {
        if (const Value* v = frame->find(e.name)) return *v;
        Value g;
        if (lookup_global(e.name, g)) return g;
        return Value::undefined("'" + e.name + "' is undefined");
      }
      case ExprKind::kGetAttr:
        return get_attr(eval(*e.children[0], frame), e.name);
      case ExprKind::kGetItem: {
        Value obj = eval(*e.children[0], frame);
        const Expr& key = *e.children[1];
        if (key.kind == ExprKind::kSlice) {
          auto part = [&](size_t k) {
            return key.children[k] ? eval(*key.children[k], frame) : Value::none();
          };
          Value start = part(0), stop = part(1), step = part(2);
          return get_slice(obj, start, stop, step);
        }
        return get_item(obj, eval(key, frame));
      }
      case ExprKind::kSlice:
        throw RuntimeError{"slice outside of a subscript"};
      case ExprKind::kCall: {
        Value callee = eval(*e.children[0], frame);
        CallArgs args = eval_args(e, 1, frame);
        return call_value(callee, args);
      }
      case ExprKind::kFilter: {
        Value input = eval(*e.children[0], frame);
        CallArgs args = eval_args(e, 1, frame);
        return apply_filter(e.name, input, args);
      }
      case ExprKind::kTest: {
        Value v = eval(*e.children[0], frame);
        CallArgs args = eval_args(e, 1, frame);
        return Value::boolean(apply_test(e.name, v, args) != e.negated);
      }
      case ExprKind::kNeg:
        return negate(eval(*e.children[0], frame));
      case ExprKind::kPos:
        return unary_plus(eval(*e.children[0], frame));
      case ExprKind::kNot:
        return Value::boolean(!truthy(eval(*e.children[0], frame)));
      case ExprKind::kBinary: {
        Value a = eval(*e.children[0], frame);
        Value b = eval(*e.children[1], frame);
        return binary_op(e.name, a, b);
      }
      case ExprKind::kAnd: {
        Value a = eval(*e.children[0], frame);
        return truthy(a) ? eval(*e.children[1], frame) : a;
      }
      case ExprKind::kOr: {
        Value a = eval(*e.children[0], frame);
        return truthy(a) ? a : eval(*e.children[1], frame);
      }
      case ExprKind::kCompare: {
        Value left = eval(*e.children[0], frame);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.children[k + 1], frame);
          if (!compare(e.ops[k], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::kConcat: {
        // Joined with Str::concat, so `set ns.text = ns.text ~ piece` appends in place.
        Str s;
        bool first = true;
        for (const auto& c : e.children) {
          Value v = eval(*c, frame);
          if (first && v.is_string()) {
            s = v.s;
          } else {
            const std::string printed = v.is_string() ? std::string() : py_str(v);
            const std::string_view part = v.is_string() ? v.s.view() : printed;
            if (part.size() > kMaxStringBytes - s.size())
              throw UnsupportedError{"unsupported string concatenation beyond 64 MiB"};
            s = Str::concat(s, part);
          }
          first = false;
        }
        return Value::string(std::move(s));
      }
      case ExprKind::kCond: {
        if (truthy(eval(*e.children[0], frame))) return eval(*e.children[1], frame);
        if (e.children[2]) return eval(*e.children[2], frame);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      }
      case ExprKind::kList:
      case ExprKind::kTuple: {
        std::vector<Value> items;
        items.reserve(e.children.size());
        for (const auto& c : e.children) items.push_back(eval(*c, frame));
        return e.kind == ExprKind::kList ? Value::list(std::move(items))
                                         : Value::tuple(std::move(items));
      }
      case ExprKind::kDict: {
        Value d;
        d.kind = Kind::kDict;
        d.dict = std::make_shared<Dict>();
        for (size_t k = 0; k + 1 < e.children.size(); k += 2) {
          Value key = eval(*e.children[k], frame);
          if (key.kind == Kind::kDict || key.is_seq(SeqKind::kList)) {
            throw RuntimeError{"unhashable type: '" + type_name(key) + "'"};
          }
          d.dict->set(std::move(key), eval(*e.children[k + 1], frame));
        }
        return d;
      }
      case ExprKind::kNsRef:
        throw RuntimeError{"namespace reference outside of an assignment"};
    }
    throw RuntimeError{"unknown expression"};
  }

  int depth_ = 0;
  // Namespaces are the only values a template can change after creating them, so only an
  // assignment to one can close a reference cycle (`set ns.self = ns`, or through a list or
  // another namespace). Nothing of a render outlives it: their attributes are dropped at its
  // end, which breaks every cycle (they leaked a render's values before).
  std::vector<std::weak_ptr<Namespace>> assigned_;

 public:
  Renderer() = default;
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;
  ~Renderer() {
    for (const auto& weak : assigned_)
      if (auto ns = weak.lock()) ns->attrs.clear();
  }
};

}  // namespace

std::string render_template(const Body& body, const nlohmann::ordered_json& context,
                            RenderStats* stats) {
  // The limits above bound what a template builds; this is the backstop for anything they miss,
  // so a hostile template fails its request instead of ending the process.
  try {
    return Renderer().render(body, context, stats);
  } catch (const std::bad_alloc&) {
    throw Error("chat template: rendering ran out of memory");
  } catch (const std::length_error& e) {
    throw Error(std::string("chat template: rendering needs a value larger than possible (") +
                e.what() + ")");
  }
}

}  // namespace tandem::text::jinja
